"""Where the pricing misses a run of the engine bench: its tokens grouped by what they did, the
measured and the priced mean time of each group side by side.

    python benchmarks/priced_by_counts.py [--bench results/engine_bench/cpu.parquet]
        [--run llama_cpp_27861] [--min-tokens 8]

Reads a finished bench (its parquet's metadata: the unit costs it priced with; its token-layer
parquet: every round's per-token wall times and counts), prices each round's counts as the
bench did (`moesub.pricing.price_stream`, from an idle link), and groups the tokens by their
host experts, background requests and landed admissions (summed over the layers). A group's
difference, priced less measured, that grows with one count and not the others is that count's
term mispriced: e.g. the tokens whose only work beyond the hits is uploads landed a token
after their reads time the install alone (docs/measurements.md, 2026-12-03).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from moesub.engine.bench_runs import read_bench_counts
from moesub.hardware import HardwareProfile, ModelBytes
from moesub.io import read_metadata
from moesub.policy import Policy
from moesub.pricing import HOST, LANDED, REQUESTS, price_stream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default="results/engine_bench/cpu.parquet")
    ap.add_argument("--run", default="llama_cpp_27861")
    ap.add_argument("--min-tokens", type=int, default=8, help="groups with fewer are left out")
    a = ap.parse_args()
    bench = Path(a.bench)
    counts_path = bench.with_name(bench.stem + "_token_layers.parquet")
    meta, counts_meta = read_metadata(bench), read_metadata(counts_path)
    runs = read_bench_counts(counts_path)
    if a.run not in runs:
        raise SystemExit(f"--run {a.run!r}: the bench has {sorted(runs)}")
    # the bench's own prices: its measured profile, priced for its experts
    costs = HardwareProfile.from_dict("bench", meta["profile"]).price(
        ModelBytes(meta["expert_bytes"])
    )
    delay = Policy.from_dict(counts_meta["policies"][a.run]).delay
    groups: dict[tuple[int, int, int], list[tuple[float, float]]] = defaultdict(list)
    for wall_s, counts in runs[a.run]:
        priced = price_stream(counts, delay, costs).token_s
        per_token = counts.sum(axis=1)  # (T, F)
        for t, (w, p) in enumerate(zip(wall_s, priced, strict=True)):
            key = (int(per_token[t, HOST]), int(per_token[t, REQUESTS]), int(per_token[t, LANDED]))
            groups[key].append((w, p))
    print(f"{a.run} in {bench}: tokens by (host experts, requests, landed), ms per token")
    print(f"{'host':>4} {'req':>4} {'landed':>6} {'tokens':>6} {'measured':>9} {'priced':>8} "
          f"{'diff':>7}")  # fmt: skip
    for key in sorted(groups):
        rows = np.array(groups[key]) * 1e3
        if len(rows) < a.min_tokens:
            continue
        m, p = rows.mean(axis=0)
        print(
            f"{key[0]:>4} {key[1]:>4} {key[2]:>6} {len(rows):>6} {m:>9.2f} {p:>8.2f} {p - m:>+7.2f}"
        )


if __name__ == "__main__":
    main()
