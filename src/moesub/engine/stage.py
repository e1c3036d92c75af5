"""The engine stage: every stream of a capture decoded under one policy (`run_engine`), and the
per-policy summary of the stage's outputs (`summarize_engine`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
from tqdm.auto import tqdm

from moesub.engine.contention import CpuMeter
from moesub.engine.generate import EngineModel
from moesub.engine.spec import resolve_engine
from moesub.engine.tiers import disk_clock
from moesub.io import require_file, write_parquet
from moesub.policy import ALL_RESIDENT, STATUS_NAMES, TOKEN_LAYER_FIELDS
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
    """Decode every stream of a capture token table with the real offloading engine.

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
    from moesub.artefacts import check_token_table, iter_streams
    from moesub.policy import CORE_BUILD_ID

    require_file(model_dir, "model_dir")
    tokens_path = require_file(tokens_path, "tokens_path")
    spec = resolve_engine(
        model_dir, name, policy, size, device, params,
        ranking_path=None if name == ALL_RESIDENT else ranking_path,
        allocation_path=allocation_path,
    )  # fmt: skip
    opts = spec.opts
    tokens = check_token_table(pl.read_parquet(tokens_path), spec.info.vocab_size)
    streams = list(iter_streams(tokens))[: opts.max_streams]

    frames = []
    admit_wait_s, admitted, admit_latency = 0.0, 0, 0
    with EngineModel(model_dir, spec) as eng:
        setup = eng.setup
        disk0 = disk_clock(setup.tier)
        meter = CpuMeter().start()
        bar = tqdm(streams, desc=f"engine {name}", unit="stream", disable=not opts.progress)
        for stream, rows in bar:
            rows = rows.head(opts.max_tokens) if opts.max_tokens else rows
            r = eng.decode(rows["token_id"].to_numpy())
            admit_wait_s += float(r["admit_wait_s"].sum())
            admitted += int(r["admitted"].sum())
            admit_latency += int(r["admit_latency"].sum())
            frames.append(
                pl.DataFrame(
                    {
                        "stream": np.full(len(rows), stream, np.int32),
                        "pos": rows["pos"].to_numpy().astype(np.int32),
                        "wall_s": r["wall_s"],
                        "fetch_wait_s": r["fetch_wait_s"],
                        "bytes_sync": r["bytes_sync"],
                        "bytes_bg": r["bytes_bg"],
                        **{
                            n: r["counts"][:, i].astype(np.int32)
                            for i, n in enumerate(STATUS_NAMES)
                        },  # fmt: skip
                        "nll": r["nll"],
                        "mass": r["mass"],
                        "syncs": r["syncs"].astype(np.int32),
                        **{c: r[c] for c in OVERLAP_COLUMNS},
                    }
                ).with_columns(pl.col("nll").fill_nan(None), counts_column(r["layer_counts"]))
            )
        cpu = meter.stop()
        disk = disk_clock(setup.tier) - disk0
    out = pl.concat(frames)
    nll = out["nll"].fill_null(np.nan).to_numpy()
    meta = {
        "policy": spec.policy_meta,
        "name": name,
        "fraction": spec.fraction,
        "capacity": int(spec.capacity),
        "size": spec.size.to_dict(),
        "layout": spec.layout,
        "device": str(setup.device),
        "tier": setup.tier.description,
        "tier_kind": setup.tier.kind,
        "expert_bytes": int(setup.expert_bytes),
        "core_build_id": CORE_BUILD_ID,
        "num_layers": setup.info.num_layers,
        "dtype": opts.dtype,
        "admission": opts.admission,
        "admit_wait_s": admit_wait_s,  # blocked on due admissions (admission="delay" only)
        # tokens from an admission's request to its install (the core's delay under "delay")
        "admit_latency_tokens_mean": admit_latency / admitted if admitted else math.nan,
        "syncs_per_token_mean": float(out["syncs"].mean()),
        "summary": summary(out["wall_s"].to_numpy(), nll),
        "admissions_installed": int(out["bytes_bg"].sum() // max(setup.expert_bytes, 1)),
        "prefetch_timeliness": timeliness(out),
        "token_layer_fields": list(TOKEN_LAYER_FIELDS),
        # the disk's speed while the run read (`moesub.price` prices the run at it too)
        "disk_reads": disk.reads,
        "disk_busy_s": disk.busy_s,
        **cpu,
    }
    if setup.bandwidth:
        meta.update(setup.bandwidth)
    return write_parquet(out, out_path, metadata=meta)


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
