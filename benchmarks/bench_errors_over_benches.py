"""The engine bench's pricing error per policy over many benches: each bench refitted offline.

    python benchmarks/bench_errors_over_benches.py results/engine_bench/cpu.parquet \
        saved/q2.parquet saved/q4.parquet ...

One bench's `sim_rel_error` is one draw of the machine's noise (docs/pricing.md, "Over many
benches"). For each bench output given (with its `<stem>_token_layers.parquet` beside), this
rebuilds its runs from the per-token-layer table and the metadata (each run's disk clock from
`disk_read_s`, its reads counted as its fetches, host experts and background requests), refits
its calibration with the library's `moesub.engine.bench_runs.fit_bench_costs` at the current
code, prices every policy's counts and checks that each stored `sim_rel_error` comes back
(a bench made by other code may not: its rows are marked). It prints each bench's count
within 10%, then per policy the mean, standard deviation and range over the benches, and how
many are beyond 10%.
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import numpy as np
import polars as pl

from moesub.engine.bench import CAL_HITS, CAL_HITS_ONE_LAYER, CALIBRATION_POLICIES, BenchParams
from moesub.engine.bench_runs import counts_path_for, fit_bench_costs, read_bench_counts
from moesub.hardware import PRICE_HELD_TO
from moesub.io import read_metadata
from moesub.pricing import price_stream
from moesub.run_speed import DiskClock
from moesub.vocabulary import TOKEN_LAYER_FIELDS

READS = [TOKEN_LAYER_FIELDS.index(f) for f in ("fetch", "host", "admission_requests")]


def refitted_errors(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    """(each policy's error refitted now, as stored) for one bench output."""
    meta = read_metadata(path)
    counts_path = counts_path_for(path)
    delays = {n: d["delay"] for n, d in read_metadata(counts_path)["policies"].items()}
    disk_read_s = meta["disk_read_s"]
    runs = {}
    for name, rounds in read_bench_counts(counts_path).items():
        runs[name] = []
        for i, (wall, counts) in enumerate(rounds):
            per = (disk_read_s.get(name) or [None] * len(rounds))[i]
            reads = int(counts[..., READS].sum())
            disk = DiskClock(reads, reads * per) if per else DiskClock(0, 0.0)
            # what fit_bench_costs reads of a `BenchRun`
            runs[name].append(types.SimpleNamespace(wall_s=wall, layer_counts=counts, disk=disk))
    p = BenchParams.from_dict(meta["params"])
    calibration = (CAL_HITS, CAL_HITS_ONE_LAYER, *CALIBRATION_POLICIES)
    fit = (meta["profile"]["host_reads_link"], p.top_k, p.layers, p.layout().expert_bytes)
    micro = meta["microbenchmarks"]["runs"]
    _seconds, costs, _reference = fit_bench_costs(runs, calibration, micro, *fit)
    stored = dict(pl.read_parquet(path).select("policy", "sim_rel_error").iter_rows())
    now = {}
    for name in stored:
        priced = sum(float(price_stream(r.layer_counts, delays[name], costs).token_s.sum())
                     for r in runs[name])  # fmt: skip
        now[name] = priced / sum(float(r.wall_s.sum()) for r in runs[name]) - 1.0
    return now, stored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("benches", nargs="+", type=Path, help="bench outputs (cpu.parquet and copies)")
    args = ap.parse_args()
    per_policy: dict[str, list[float]] = {}
    for path in args.benches:
        now, stored = refitted_errors(path)
        moved = [n for n in now if abs(now[n] - stored[n]) > 1e-9]
        within = sum(abs(e) <= PRICE_HELD_TO for e in now.values())
        note = f"; refitted differently from the stored: {moved}" if moved else ""
        print(f"{path}: {within} of {len(now)} within {100 * PRICE_HELD_TO:g}%{note}")
        for name, e in now.items():
            per_policy.setdefault(name, []).append(e)
    print("\n| policy | mean | sd | range | beyond 10% |\n| --- | --- | --- | --- | --- |")
    for name, errs in sorted(per_policy.items()):
        e = 100 * np.array(errs)
        sd = e.std(ddof=1) if len(e) > 1 else float("nan")
        beyond = int((np.abs(e) > 100 * PRICE_HELD_TO).sum())
        spread = f"{e.min():+.1f}% to {e.max():+.1f}%"
        print(f"| `{name}` | {e.mean():+.1f}% | {sd:.1f} | {spread} | {beyond} |")


if __name__ == "__main__":
    main()
