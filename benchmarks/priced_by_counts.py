"""Where the pricing misses an engine run: its tokens grouped by what they did, the measured and
the priced mean time of each group side by side, and the residual's slope in each count.

    python benchmarks/priced_by_counts.py [--bench results/engine_bench/cpu.parquet]
        [--run llama_cpp_27861] [--min-tokens 8]
    python benchmarks/priced_by_counts.py \\
        --engine-run results/ckpt_olmoe/engine/cpu/quality/f0.25.parquet

Reads a finished bench (its parquet's metadata: the unit costs it priced with; its token-layer
parquet: every round's per-token wall times and counts), or one engine run of the pipeline
(its per-token counts, priced under its model's `this_machine` profile at the disk's speed
while it read, as `moesub.price` does: `results/{model}/hardware/this_machine.json` beside it,
or `--profile`). Each stream or round is priced from an idle link (`moesub.pricing.
price_stream`), and the tokens are grouped by their host experts, background requests and
landed admissions (summed over the layers). A group's difference, priced less measured, that
grows with one count and not the others is that count's term mispriced: e.g. the tokens whose
only work beyond the hits is uploads landed a token after their reads time the install alone
(docs/measurements.md, 2026-12-03). Below the groups, the least-squares slope of the tokens'
residual (measured less priced, ms) in each count, with a constant, tokens beyond six robust
standard deviations left out: counts that move together (a host step and its uploads) share
their slopes arbitrarily.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import polars as pl

from moesub.engine.bench_runs import read_bench_counts
from moesub.hardware import HardwareProfile, ModelBytes, UnitCosts, read_unit_costs
from moesub.io import read_metadata
from moesub.policy import Policy
from moesub.price import costs_at_run_disk, policy_delay
from moesub.pricing import FETCH, FORCED, HOST, LANDED, REQUESTS, price_stream
from moesub.token_counts import stream_counts

SLOPES = {"host": [HOST], "requests": [REQUESTS], "landed": [LANDED], "sync": [FETCH, FORCED]}
Runs = list[tuple[np.ndarray, np.ndarray]]  # per stream or round: (wall_s (T,), counts (T, L, F))


def bench_runs(bench: Path, run: str) -> tuple[Runs, UnitCosts, int]:
    """A bench run's rounds `(wall_s, counts)`, the bench's own costs and the policy's delay."""
    counts_path = bench.with_name(bench.stem + "_token_layers.parquet")
    meta, counts_meta = read_metadata(bench), read_metadata(counts_path)
    runs = read_bench_counts(counts_path)
    if run not in runs:
        raise SystemExit(f"--run {run!r}: the bench has {sorted(runs)}")
    # the bench's own prices: its measured profile, priced for its experts
    costs = HardwareProfile.from_dict("bench", meta["profile"]).price(
        ModelBytes(meta["expert_bytes"])
    )
    return runs[run], costs, Policy.from_dict(counts_meta["policies"][run]).delay


def engine_run(path: Path, profile: Path | None) -> tuple[Runs, UnitCosts, int]:
    """A pipeline engine run's streams `(wall_s, counts)`, its costs at its disk's speed and its
    policy's delay."""
    profile = profile or path.parents[3] / "hardware" / "this_machine.json"
    _name, costs = read_unit_costs(profile)
    meta = read_metadata(path)
    at_disk = json.loads(profile.read_text()).get("at_run_disk")
    costs = costs_at_run_disk(costs, at_disk, meta) or costs
    df = pl.read_parquet(path).sort("stream", "pos")
    walls = [rows["wall_s"].to_numpy() for rows in df.partition_by("stream", maintain_order=True)]
    return list(zip(walls, stream_counts(df), strict=True)), costs, policy_delay(meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="results/engine_bench/cpu.parquet")
    ap.add_argument("--run", default="llama_cpp_27861")
    ap.add_argument("--engine-run", type=Path, help="a pipeline engine run instead of the bench")
    ap.add_argument("--profile", type=Path, help="its this_machine profile (default: its model's)")
    ap.add_argument("--min-tokens", type=int, default=8, help="groups with fewer are left out")
    a = ap.parse_args()
    if a.engine_run:
        runs, costs, delay = engine_run(a.engine_run, a.profile)
        what = str(a.engine_run)
    else:
        runs, costs, delay = bench_runs(Path(a.bench), a.run)
        what = f"{a.run} in {a.bench}"
    wall, priced, per_token = [], [], []
    for wall_s, counts in runs:
        wall.append(wall_s)
        priced.append(price_stream(counts, delay, costs).token_s)
        per_token.append(counts.sum(axis=1))  # (T, F)
    wall, priced, per_token = (np.concatenate(x) for x in (wall, priced, per_token))
    keys, group = np.unique(per_token[:, [HOST, REQUESTS, LANDED]], axis=0, return_inverse=True)
    print(f"{what}: measured {1e3 * wall.mean():.3f} ms per token, priced {1e3 * priced.mean():.3f}"
          f" ({100 * (priced.mean() / wall.mean() - 1):+.1f}%)")  # fmt: skip
    print("tokens by (host experts, requests, landed), ms per token")
    print(f"{'host':>4} {'req':>4} {'landed':>6} {'tokens':>6} {'measured':>9} {'priced':>8} "
          f"{'diff':>7}")  # fmt: skip
    for g, key in enumerate(keys):  # in (host, requests, landed) order
        sel = group.ravel() == g
        n = int(sel.sum())
        if n < a.min_tokens:
            continue
        m, p = 1e3 * wall[sel].mean(), 1e3 * priced[sel].mean()
        print(f"{key[0]:>4} {key[1]:>4} {key[2]:>6} {n:>6} {m:>9.2f} {p:>8.2f} {p - m:>+7.2f}")
    resid = 1e3 * (wall - priced)
    mad = 1.4826 * np.median(np.abs(resid - np.median(resid)))
    keep = np.abs(resid - np.median(resid)) <= 6 * max(mad, 1e-12)
    used = {n: per_token[:, f].sum(axis=1) for n, f in SLOPES.items()}
    used = {n: x for n, x in used.items() if x[keep].std() > 0}
    X = np.column_stack([np.ones(len(resid)), *used.values()])[keep]
    coef = np.linalg.lstsq(X, resid[keep], rcond=None)[0]
    slopes = ", ".join(f"{n} {c:+.3f} (mean {x.mean():.2f})"
                       for (n, x), c in zip(used.items(), coef[1:], strict=True))  # fmt: skip
    print(f"residual (measured less priced, ms) over {int(keep.sum())} of {len(resid)} tokens: "
          f"constant {coef[0]:+.3f}, per count {slopes or 'none varies'}")  # fmt: skip


if __name__ == "__main__":
    main()
