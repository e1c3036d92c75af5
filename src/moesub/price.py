"""The price stage: every simulated policy's per-token-layer counts priced under one hardware
profile (`moesub.pricing`), and the engine's own counts under the profile it calibrated.

Two entry points, one rule each:

- `write_profile`: a hardware profile as this model sees it, `results/{model}/hardware/
  {hardware}.json`: the profile's keys (`this_machine`: the engine calibration's fitted
  profile; a shipped or configured one: its keys), the model's bytes it is priced for, and the
  seconds of each event (`UnitCosts`).
- `run_price`: `results/{model}/priced/{hardware}.parquet`, one row per priced run
  (`PRICED_COLUMNS`): `source` simulator (one per simulated policy and cache size, the
  simulator's tokens) or engine (this_machine only: the engine runs' own tokens, with their
  measured time and CPU share beside, and `time_per_token_at_run_disk_s`: the same tokens with
  the copies at the disk's speed while the run read, `costs_at_run_disk`, and
  `time_per_token_at_run_speed_s`: also with its compute at the machine's speed while it ran,
  probed on its own tokens that only hit, `run_speed`; and `STREAM_SUMS`, each stream's time
  and price in all, which the analysis resamples; its metadata carries this_machine's
  `calibration_run_errors`, each calibration mechanism's runs priced at the profile fitted to
  them, from the profile's `run_errors`). Every stream is priced from an idle link, as the
  caches restart. `time_per_token_serial_s` is the same
  counts priced without concurrency (the host's experts after the fast tier's), equal to
  `time_per_token_s` on a one-processor profile.

A profile change reruns its two jobs, never a replay.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import polars as pl

from moesub.config.hardware import DENSE_BITS
from moesub.hardware import (
    THIS_MACHINE,
    HardwareProfile,
    ModelBytes,
    UnitCosts,
    read_unit_costs,
    this_machine,
)
from moesub.io import read_metadata, require_file, write_json, write_parquet
from moesub.pricing import BREAKDOWN, StreamTime, price_streams
from moesub.run_speed import (
    JACKKNIFE_ERRORS,
    STREAM_SUMS,
    AtRunDisk,
    DiskClock,
    engine_jackknife,
    part_sums,
    priced_at_speed,
)
from moesub.slots import policy_fields
from moesub.token_counts import stream_counts
from moesub.vocabulary import Policy

PRICED_COLUMNS = (
    "hardware", "source", "device", "policy", "fraction", "size", "tokens", "time_per_token_s",
    "time_per_token_serial_s", "hidden_host_per_token_s", *(f"{p}_s" for p in BREAKDOWN),
    "measured_time_per_token_s", "cpu_share", "other_cores", "contended",
    "time_per_token_at_run_disk_s", "run_speed", "time_per_token_at_run_speed_s",
)  # fmt: skip


def write_profile(
    name: str,
    spec: Mapping[str, Any] | None,
    calibration_path: str | os.PathLike | None,
    model_bytes: Mapping[str, float],
    out_path: str | os.PathLike,
    checkpoint: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The profile `name` priced for a model (module doc): `spec` its keys, or for this_machine
    (spec None) the calibration's profile, priced at the calibration's own expert bytes (what
    its seconds were measured at); `model_bytes` (`ModelBytes` keys) prices the others, with a
    checkpoint's weights besides its routed experts as each MoE layer's dense bytes, at
    `DENSE_BITS`, from its check's record (`checkpoint`: `results/{model}/checkpoint.json`,
    `dense_weights_per_layer`, counted on the meta device by `moesub.models.check_checkpoint`)."""
    at_run_disk, calibration = None, {}
    if name == THIS_MACHINE:
        path = require_file(calibration_path, "calibration_path")
        profile = this_machine(path)
        calibration = json.loads(Path(path).read_text())
        bytes_ = ModelBytes(calibration["expert_bytes"])
        at_run_disk = calibration.get("at_run_disk")
    else:
        profile = HardwareProfile.from_dict(name, spec or {})
        bytes_ = ModelBytes(**model_bytes)
        if checkpoint is not None:
            record = json.loads(require_file(checkpoint, "checkpoint").read_text())
            if "dense_weights_per_layer" not in record:
                raise ValueError(
                    f"{checkpoint}: no dense_weights_per_layer (a check before they were "
                    "counted): rerun it, `snakemake --forcerun model_checkpoint`"
                )
            dense = record["dense_weights_per_layer"] * DENSE_BITS / 8
            bytes_ = replace(bytes_, dense_bytes_per_layer=dense)
    out = {
        "name": name,
        "profile": profile.to_dict(),
        "model_bytes": asdict(bytes_),
        "unit_costs": asdict(profile.price(bytes_)),
        "at_run_disk": at_run_disk,  # this_machine on a disk tier: `engine.calibrate.at_run_disk`
        # this_machine: each calibration mechanism's runs priced at the profile fitted to them
        "run_errors": calibration.get("run_errors") if name == THIS_MACHINE else None,
        # this_machine: the calibration refitted with each of its rounds left out, priced alike
        "jackknife_unit_costs": [
            asdict(HardwareProfile.from_dict(name, refit).price(bytes_))
            for refit in calibration.get("jackknife_profiles") or []
        ],
    }
    write_json(out, out_path)
    return out


def policy_delay(meta: Mapping[str, Any]) -> int:
    """A priced run's policy's admission delay, from its output's metadata (`policy`; its pins
    are in the counts)."""
    return Policy.from_dict(policy_fields(meta["policy"])).delay


def _row(
    hardware: str, source: str, costs: UnitCosts, counts: list, meta: dict,
    priced: StreamTime | None = None,
) -> dict:  # fmt: skip
    """One priced run: its streams priced with and without the host's concurrency (`priced`:
    their price at `costs`, where the caller has it)."""
    delay = policy_delay(meta)
    t = price_streams(counts, delay, costs) if priced is None else priced
    serial = (
        price_streams(counts, delay, replace(costs, concurrent_host=False))
        if (costs.concurrent_host)
        else t
    )
    n = len(t.token_s)
    return {
        "hardware": hardware,
        "source": source,
        "device": meta.get("device"),
        "policy": meta["name"],
        "fraction": float(meta["fraction"]),
        "size": (meta.get("size") or {}).get("label"),
        "tokens": n,
        "time_per_token_s": t.time_per_token_s,
        "time_per_token_serial_s": serial.time_per_token_s,
        "hidden_host_per_token_s": t.hidden_host_s / n,
        **{f"{p}_s": t.parts[p] / n for p in BREAKDOWN},
    }


def _engine_row(
    hardware: str, costs: UnitCosts, at_run_disk: Mapping[str, float] | None,
    df: pl.DataFrame, meta: dict, refits: Sequence[UnitCosts] = (),
) -> dict:  # fmt: skip
    """An engine run priced (`_row`) with its measured time and CPU share beside; its tokens at
    the disk's speed while it read (`costs_at_run_disk`; NaN where unknown), and also with its
    compute at the machine's speed while it ran (`moesub.run_speed.speed_probe` over its own
    tokens that only hit, against the price at its disk: `run_speed`; NaN speed, too few such
    tokens: that price)."""
    streams, delay = stream_counts(df), policy_delay(meta)
    priced = price_streams(streams, delay, costs)
    row = _row(hardware, "engine", costs, streams, meta, priced)
    row["measured_time_per_token_s"] = float(df["wall_s"].mean())
    row["cpu_share"] = meta.get("cpu_share")
    row["other_cores"] = meta.get("other_cores", math.nan)
    row["contended"] = meta.get("contended")
    at_disk = costs_at_run_disk(costs, at_run_disk, meta)
    wall = df.sort("stream", "pos")["wall_s"].to_numpy()  # (T,) in `stream_counts`' order
    # a tier that reads no file (at_disk None) is priced at `costs` already: not twice
    at_disk_price, row["run_speed"], at_speed = priced_at_speed(
        wall, streams, delay, at_disk or costs, None if at_disk is not None else priced.token_s
    )
    if at_disk is not None:
        row["time_per_token_at_run_disk_s"] = float(at_disk_price.mean())
    row["time_per_token_at_run_speed_s"] = float(at_speed.mean())
    # per stream, its time and its price in all: the error's interval over the streams is the
    # analysis's (`moesub.stats.pricing_error.error_interval`)
    lengths = [len(s) for s in streams]
    for column, values in zip(STREAM_SUMS, (wall, priced.token_s), strict=True):
        row[column] = part_sums(values, lengths).tolist()
    # each round of the engine stage left out, the calibration refitted without it (`refits`)
    jackknife = engine_jackknife(wall, streams, delay, refits, meta.get("stream_rounds"))
    row.update(zip(JACKKNIFE_ERRORS, jackknife, strict=True))
    return row


def costs_at_run_disk(
    costs: UnitCosts, at_run_disk: Mapping[str, float] | None, meta: Mapping[str, Any]
) -> UnitCosts | None:
    """An engine run's costs at the disk's speed while it read (its `disk_reads`,
    `disk_busy_s`) against the calibration's record (`at_run_disk`,
    `moesub.run_speed.AtRunDisk`); None where the tier reads no file, or an artefact
    predates the record."""
    if not at_run_disk or "disk_reads" not in meta:
        return None
    run = DiskClock(int(meta["disk_reads"]), float(meta["disk_busy_s"]))
    return AtRunDisk.from_dict(at_run_disk).costs(costs, run)


def run_price(
    profile_path: str | os.PathLike,
    simulate_counts: Sequence[str | os.PathLike],
    engine_outputs: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
) -> pl.DataFrame:
    """Price every simulate counts file (`simulate/{policy}/{size}.counts.parquet`) and
    every engine output (its `token_layer_counts`; this_machine only) under the profile of
    `profile_path` (`write_profile`); write the table (module doc) atomically, return it."""
    hardware, costs = read_unit_costs(profile_path)
    written = json.loads(Path(profile_path).read_text())
    at_run_disk = written.get("at_run_disk")
    refits = [UnitCosts(**c) for c in written.get("jackknife_unit_costs") or []]
    if engine_outputs and hardware != THIS_MACHINE:
        raise ValueError(
            f"price: engine runs are priced under {THIS_MACHINE!r} only (the machine they ran "
            f"on), not {hardware!r}"
        )
    rows = []
    for path in simulate_counts:
        meta = read_metadata(require_file(path, "simulate_counts"))
        counts = stream_counts(pl.read_parquet(path))
        rows.append(_row(hardware, "simulator", costs, counts, meta))
    for path in engine_outputs:
        meta = read_metadata(require_file(path, "engine_outputs"))
        df = pl.read_parquet(path)
        if "token_layer_counts" not in df.columns:
            raise ValueError(f"{path}: an engine output without per-token-layer counts (rerun it)")
        rows.append(_engine_row(hardware, costs, at_run_disk, df, meta, refits))
    schema = {c: pl.Float64 for c in PRICED_COLUMNS}
    lists = dict.fromkeys((*STREAM_SUMS, *JACKKNIFE_ERRORS), pl.List(pl.Float64))
    schema.update(hardware=pl.String, source=pl.String, device=pl.String, policy=pl.String,
                  size=pl.String, tokens=pl.Int64, contended=pl.Boolean, **lists)  # fmt: skip
    out = pl.DataFrame(rows, schema=schema)
    meta = {"hardware": hardware, "unit_costs": asdict(costs)}
    if written.get("run_errors"):  # this_machine's calibration runs, priced at its profile
        meta["calibration_run_errors"] = written["run_errors"]
    write_parquet(out, out_path, metadata=meta)
    return out
