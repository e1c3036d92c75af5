"""The engine stage: every stream of a capture decoded under one policy (`PolicyRun`,
`run_engine`), the pipeline's job that interleaves every policy's runs with the calibration
(`run_engine_stage`), and the per-policy summary of the stage's outputs (`summarize_engine`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from moesub.engine.adapter import LoadedModel, load_engine_model
from moesub.engine.contention import CpuMeter
from moesub.engine.generate import EngineModel
from moesub.engine.spec import resolve_engine
from moesub.engine.tiers import disk_clock
from moesub.io import require_file, write_json, write_parquet
from moesub.policy import ALL_RESIDENT, STATUS_NAMES, TOKEN_LAYER_FIELDS
from moesub.run_speed import DiskClock
from moesub.token_counts import counts_column

# per token: time blocked on synchronous fetches, due admissions, late prefetches and the host's
# experts; bytes moved per kind; prefetch copies issued and landed in time
OVERLAP_COLUMNS = (
    "admit_wait_s", "prefetch_wait_s", "host_wait_s", "bytes_prefetch", "bytes_host",
    "prefetches", "prefetch_in_time",
)  # fmt: skip
BYTE_COLUMNS = ("bytes_sync", "bytes_bg", "bytes_prefetch", "bytes_host")
ROW_COLUMNS = (
    "stream", "pos", "wall_s", "fetch_wait_s", "bytes_sync", "bytes_bg",
    *STATUS_NAMES, "nll", *OVERLAP_COLUMNS,
)  # fmt: skip


def summary(wall_s: np.ndarray, nll: np.ndarray) -> dict[str, float]:
    ok = np.isfinite(nll)
    return {
        "tokens": int(len(wall_s)),
        "time_per_token_median_s": float(np.median(wall_s)) if len(wall_s) else math.nan,
        "time_per_token_p90_s": float(np.percentile(wall_s, 90)) if len(wall_s) else math.nan,
        "time_per_token_mean_s": float(np.mean(wall_s)) if len(wall_s) else math.nan,
        "ppl": float(np.exp(nll[ok].mean())) if ok.any() else math.nan,
    }


def timeliness(df: pl.DataFrame) -> float:
    """Share of the prefetch copies that landed before their layer's step (NaN: none issued,
    or an output written before prefetch existed)."""
    if "prefetches" not in df.columns:
        return math.nan
    issued = int(df["prefetches"].sum())
    return int(df["prefetch_in_time"].sum()) / issued if issued else math.nan


def mean_of(df: pl.DataFrame, column: str) -> float:
    """A column's mean; NaN for an output written before the column existed."""
    return float(df[column].mean()) if column in df.columns else math.nan


class PolicyRun:
    """One policy's engine run over the streams of a capture token table, decoded in parts
    (`decode(streams)`, each part on an engine of its own, so that a stage can interleave the
    parts of several policies and the calibration's runs) and written once all are done
    (`write`). Each stream starts from fresh caches whichever engine decodes it, so the rows do
    not depend on the parts. Every input is checked on construction, before any decoding."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        tokens_path: str | os.PathLike,
        ranking_path: str | os.PathLike,
        name: str,
        policy: Mapping[str, Any],
        size: float | Mapping[str, Any],
        device: str,
        params: Mapping[str, Any] | None = None,
        allocation_path: str | os.PathLike | None = None,
    ) -> None:
        from moesub.artefacts import check_token_table, iter_streams

        require_file(model_dir, "model_dir")
        tokens_path = require_file(tokens_path, "tokens_path")
        self.model_dir, self.name = model_dir, name
        self.spec = resolve_engine(
            model_dir, name, policy, size, device, params,
            ranking_path=None if name == ALL_RESIDENT else ranking_path,
            allocation_path=allocation_path,
        )  # fmt: skip
        opts = self.spec.opts
        tokens = check_token_table(pl.read_parquet(tokens_path), self.spec.info.vocab_size)
        self.streams = [
            (stream, rows.head(opts.max_tokens) if opts.max_tokens else rows)
            for stream, rows in list(iter_streams(tokens))[: opts.max_streams]
        ]
        self.frames: dict[int, pl.DataFrame] = {}  # by position in `streams`
        self.rounds: dict[int, int] = {}  # by position: the engine stage's round that decoded it
        self.admit_wait_s, self.admitted, self.admit_latency = 0.0, 0, 0
        self.disks: list[DiskClock] = []  # what each part read from the expert file
        self.meter = CpuMeter()
        self.setup_meta: dict[str, Any] = {}
        self.bandwidth: dict[str, Any] = {}

    def decode(
        self,
        parts: Sequence[int],
        progress: bool = True,
        loaded: LoadedModel | None = None,
        round_: int | None = None,
    ) -> None:
        """Decode the streams at positions `parts` on a fresh engine (on `loaded`, the model
        loaded once for many engines, if given; a bar per stream if `progress` and the engine's
        options allow), in the engine stage's round `round_` if it is one."""
        with EngineModel(self.model_dir, self.spec, loaded) as eng:
            setup = eng.setup
            disk0 = disk_clock(setup.tier)
            self.meter.start()
            bar = tqdm(parts, desc=f"engine {self.name}", unit="stream",
                       disable=not (progress and self.spec.opts.progress))  # fmt: skip
            for i in bar:
                stream, rows = self.streams[i]
                r = eng.decode(rows["token_id"].to_numpy())
                self.admit_wait_s += float(r["admit_wait_s"].sum())
                self.admitted += int(r["admitted"].sum())
                self.admit_latency += int(r["admit_latency"].sum())
                self.frames[i] = token_rows(stream, rows["pos"].to_numpy(), r)
                if round_ is not None:
                    self.rounds[i] = round_
            self.meter.pause()
            self.disks.append(disk_clock(setup.tier) - disk0)
            self.setup_meta = {
                "device": str(setup.device),
                "tier": setup.tier.description,
                "tier_kind": setup.tier.kind,
                "expert_bytes": int(setup.expert_bytes),
                "num_layers": setup.info.num_layers,
            }
            # the expert store's reads, measured once when the job loaded the model
            self.bandwidth = dict(setup.bandwidth or {})

    def write(self, out_path: str | os.PathLike) -> Path:
        """The rows of every stream in order (`run_engine` says which) and the run's metadata,
        written atomically; every stream must have been decoded."""
        from moesub.policy import CORE_BUILD_ID

        missing = [s for i, (s, _rows) in enumerate(self.streams) if i not in self.frames]
        if missing:
            raise ValueError(f"engine run {self.name!r}: streams {missing} were not decoded")
        spec, opts = self.spec, self.spec.opts
        out = pl.concat([self.frames[i] for i in range(len(self.streams))])
        nll = out["nll"].fill_null(np.nan).to_numpy()
        admitted, disk = self.admitted, DiskClock.pooled(self.disks)
        meta = {
            "policy": spec.policy_meta,
            "name": self.name,
            "fraction": spec.fraction,
            "capacity": int(spec.capacity),
            "size": spec.size.to_dict(),
            "layout": spec.layout,
            **{k: self.setup_meta[k] for k in ("device", "tier", "tier_kind", "expert_bytes")},
            "core_build_id": CORE_BUILD_ID,
            "num_layers": self.setup_meta["num_layers"],
            "dtype": opts.dtype,
            "admission": opts.admission,
            "admit_wait_s": self.admit_wait_s,  # blocked on due admissions (admission="delay")
            # tokens from an admission's request to its install (the core's delay under "delay")
            "admit_latency_tokens_mean": self.admit_latency / admitted if admitted else math.nan,
            "syncs_per_token_mean": float(out["syncs"].mean()),
            "summary": summary(out["wall_s"].to_numpy(), nll),
            "admissions_installed": int(
                out["bytes_bg"].sum() // max(self.setup_meta["expert_bytes"], 1)
            ),
            "prefetch_timeliness": timeliness(out),
            "token_layer_fields": list(TOKEN_LAYER_FIELDS),
            # the disk's speed while the run read (`moesub.price` prices the run at it too)
            "disk_reads": disk.reads,
            "disk_busy_s": disk.busy_s,
            # the engine stage's round each stream was decoded in, streams in increasing id as
            # `stream_counts` gives them (the calibration's refits without each round price the
            # rest: `moesub.run_speed.engine_jackknife`)
            "stream_rounds": (
                [self.rounds[i] for i in sorted(self.rounds, key=lambda i: self.streams[i][0])]
                if len(self.rounds) == len(self.streams)
                else None
            ),  # fmt: skip
            **self.meter.stop(),
            **self.bandwidth,
        }
        return write_parquet(out, out_path, metadata=meta)


def token_rows(stream: int, pos: np.ndarray, r: Mapping[str, Any]) -> pl.DataFrame:
    """One stream's rows (`ROW_COLUMNS`, `mass`, `syncs`, `token_layer_counts`) from its
    decode (`EngineModel.decode`)."""
    return pl.DataFrame(
        {
            "stream": np.full(len(pos), stream, np.int32),
            "pos": pos.astype(np.int32),
            "wall_s": r["wall_s"],
            "fetch_wait_s": r["fetch_wait_s"],
            "bytes_sync": r["bytes_sync"],
            "bytes_bg": r["bytes_bg"],
            **{n: r["counts"][:, i].astype(np.int32) for i, n in enumerate(STATUS_NAMES)},
            "nll": r["nll"],
            "mass": r["mass"],
            "syncs": r["syncs"].astype(np.int32),
            **{c: r[c] for c in OVERLAP_COLUMNS},
        }
    ).with_columns(pl.col("nll").fill_nan(None), counts_column(r["layer_counts"]))


def run_engine(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    size: float | Mapping[str, Any],
    device: str,
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
    allocation_path: str | os.PathLike | None = None,
) -> Path:
    """Decode every stream of a capture token table with the real offloading engine, on one
    engine (`PolicyRun`; the pipeline's stage interleaves the policies: `run_engine_stage`).

    Writes one row per token (`ROW_COLUMNS`: `stream, pos, wall_s, fetch_wait_s, bytes_sync,
    bytes_bg, hit, fetch, sub, host, forced, nll` and the overlap's `OVERLAP_COLUMNS`, plus
    `mass`, `syncs`: host waits for the device, and `token_layer_counts`: what the policy did
    at each layer, `moesub.token_counts`) with metadata `policy, name, fraction, capacity,
    size, layout, device, tier, ...`, the admissions' latency in tokens (request to install), a
    `summary` (median / p90 time per token, perplexity), the run's CPU share (`cpu_share`,
    `contended`: `moesub.engine.contention`) and what it read from the expert file
    (`disk_reads`, `disk_busy_s`: `moesub.engine.tiers.disk_clock`).
    `name == "all_resident"` holds every expert in fast memory (the floor on time per token).
    Each stream starts from fresh caches holding the layout's initial sets (the expert
    ranking's prefixes, as in emulate; a planned layout's C_l slots per layer,
    `moesub.engine.spec.resolve_engine`). Every input is checked before decoding; the output is
    written atomically at the end.
    """
    run = PolicyRun(model_dir, tokens_path, ranking_path, name, policy, size, device, params,
                    allocation_path)  # fmt: skip
    run.decode(range(len(run.streams)))
    return run.write(out_path)


def run_engine_stage(
    model_dir: str | os.PathLike,
    device: str,
    tokens_path: str | os.PathLike,
    calib_tokens_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    runs: Mapping[str, tuple[str, Mapping[str, Any], Mapping[str, Any], str | None]],
    calibration_size: float | Mapping[str, Any],
    calibration_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> None:
    """The pipeline's engine stage for one model on one device: every policy run (`runs`:
    output path -> `(name, policy, size, allocation_path or None)`, each as `run_engine`
    writes it) and the calibration (`moesub.engine.calibrate.Calibration` at
    `calibration_size` on the calibration tokens, its JSON to `calibration_path`), interleaved
    as the engine bench interleaves them: the calibration's mechanisms spread among the runs
    (`spread`), that order rotated over `engine.calibrate_rounds` rounds (`round_order`), each
    run decoding its share of the streams in each round (on an engine of its own, as every
    calibration run). The simulator is held to these runs with the profile fitted beside them:
    a machine whose speed drifts (on a 2-vCPU VM by up to 40% in stretches of 20-30 s,
    2026-12-05) then slows the calibration and the runs alike, if the rounds are short beside
    those stretches (the shipped config: 16 rounds of one short stream per run). Every input is
    checked before a run; every output is written at the end, each atomically. The model is
    loaded once (`load_engine_model`: the checkpoint read, the store checked, on CUDA the pinned
    experts filled) and every run's engine is built on it with a tier of its own."""
    from moesub.engine.calibrate import MECHANISMS, Calibration, round_order, spread

    cal = Calibration(model_dir, device, calib_tokens_path, ranking_path, calibration_size,
                      params)  # fmt: skip
    policy_runs = {
        out: PolicyRun(
            model_dir, tokens_path, ranking_path, name, policy, size, device, params, allocation
        )  # fmt: skip
        for out, (name, policy, size, allocation) in runs.items()
    }
    rounds = cal.opts.calibrate_rounds
    parts = {out: np.array_split(np.arange(len(r.streams)), rounds)
             for out, r in policy_runs.items()}  # fmt: skip
    order = round_order(spread(list(MECHANISMS), list(policy_runs)), rounds)
    per_round = len(MECHANISMS) + len(policy_runs)
    loaded = load_engine_model(model_dir, device, cal.opts, measure_bandwidth=True)
    try:
        bar = tqdm(order, desc="engine stage", unit="run", disable=not cal.opts.progress)
        for step, key in enumerate(bar):
            if key in MECHANISMS:
                cal.run(key, loaded)
            elif len(part := parts[key][step // per_round]):
                policy_runs[key].decode(
                    part.tolist(), progress=False, loaded=loaded, round_=step // per_round
                )
    finally:
        loaded.close()
    for out, run in policy_runs.items():
        run.write(out)
    write_json(cal.result(), Path(calibration_path))


def summarize_engine(
    paths: Mapping[str, str | os.PathLike],
    baseline: str = "fetch_every_miss",
    host_baseline: str = "host_compute",
) -> pl.DataFrame:
    """Per-policy summary over engine outputs `{name: path}` (same model, device, streams):
    median / p90 time per token, speedup vs `baseline` and `host_baseline` (median time ratio),
    perplexity and Δppl % vs `baseline`; per token, the mean time blocked on synchronous
    fetches, late prefetches and the host's experts, the mean bytes moved per kind, and the
    share of prefetch copies landed in time."""
    rows = []
    for name, path in paths.items():
        df = pl.read_parquet(require_file(path, f"paths[{name!r}]"))
        nll = df["nll"].drop_nulls().to_numpy()
        wall = df["wall_s"].to_numpy()
        rows.append(
            {
                "policy": name,
                "tokens": df.height,
                "time_per_token_median_s": float(np.median(wall)),
                "time_per_token_p90_s": float(np.percentile(wall, 90)),
                "fetch_wait_s": float(df["fetch_wait_s"].mean()),
                "prefetch_wait_s": mean_of(df, "prefetch_wait_s"),
                "host_wait_s": mean_of(df, "host_wait_s"),
                **{c: mean_of(df, c) for c in BYTE_COLUMNS},
                "prefetch_timeliness": timeliness(df),
                "ppl": float(np.exp(nll.mean())),
            }
        )
    from moesub.metrics import dppl_pct, speedup  # the project's one Δppl and speedup

    out = pl.DataFrame(rows)
    by = {r["policy"]: r for r in rows}
    times = out["time_per_token_median_s"].to_numpy()
    for col, base in (
        ("speedup_vs_fetch_every_miss", baseline),
        ("speedup_vs_host_compute", host_baseline),
    ):
        ref = by.get(base, {}).get("time_per_token_median_s", np.nan)
        out = out.with_columns(pl.Series(col, speedup(ref, times), dtype=pl.Float64))
    ref_nll = np.log(by[baseline]["ppl"]) if baseline in by else np.nan
    dppl = dppl_pct(np.log(out["ppl"].to_numpy()) - ref_nll)
    return out.with_columns(pl.Series("dppl_pct_vs_fetch_every_miss", dppl, dtype=pl.Float64))
