"""Whether an expert read costs the same however the reads before it were spaced: the disk's
time per read against the gap before it.

    python benchmarks/bench_disk_gaps.py [--store results/engine_bench/bench_experts.bin]
        [--reads 16] [--trials 10] [--gaps 0,1,3,6,12]

The pricing gives every copy on the disk tier one time, `copy_s` (docs/pricing.md), whether it
is one of the host worker's back-to-back reads or an admission read alone between two layers'
compute; the calibration moves it by each run's mean time per read (`AtRunDisk`). This reads,
through `ExpertStore.read_into` (the engine's path), `--reads` random whole experts one after
another with `gap` ms of sleep after each, for every gap in turn (the order rotated per trial, so
the disk's drift falls on all of them), after a 50 ms rest. It prints per gap the median time
per read (the first read after the rest apart: `first`), and per trial the ratio of each gap's
median to the back-to-back reads' (`--gaps` must include 0): 1 everywhere is the one time the
pricing assumes. Without `--store` (or when it is missing) it writes a store of `--experts`
random 6 MiB experts into a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_disk_overlap import store_arguments, store_path

from moesub.engine.store import ExpertStore, aligned_empty

REST_S = 0.05  # before each gap's reads


def spaced_reads(store: ExpertStore, flat: np.ndarray, gap_s: float, buf: tuple) -> np.ndarray:
    """Seconds of each read of `flat` (layer-major expert indices), `gap_s` of sleep after each."""
    E = store.layout.num_experts
    out = np.empty(len(flat))
    for j, i in enumerate(flat.tolist()):
        t0 = time.perf_counter()
        store.read_into(i // E, i % E, *buf)
        out[j] = time.perf_counter() - t0
        if gap_s:
            time.sleep(gap_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    store_arguments(ap, "reads per gap per trial")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--gaps", default="0,1,3,6,12", help="ms of sleep after each read")
    args = ap.parse_args()
    gaps = [float(g) for g in args.gaps.split(",")]
    if 0.0 not in gaps or min(gaps) < 0:
        raise SystemExit(f"--gaps {args.gaps!r}: non-negative ms, 0 among them (the baseline)")
    with tempfile.TemporaryDirectory(prefix="moesub_gaps_") as tmp:
        path = store_path(args.store, Path(tmp), args.experts, args.seed)
        with ExpertStore(path) as store:
            lay = store.layout
            buf = (aligned_empty(lay.gate_up_shape, lay.torch_dtype),
                   aligned_empty(lay.down_shape, lay.torch_dtype))  # fmt: skip
            n = lay.num_layers * lay.num_experts
            rng = np.random.default_rng(args.seed)
            times = {g: [] for g in gaps}  # per gap, per trial: (reads,) seconds
            for trial in range(args.trials):
                for g in np.roll(gaps, trial).tolist():
                    time.sleep(REST_S)
                    picks = rng.choice(n, size=args.reads, replace=False)
                    times[g].append(spaced_reads(store, picks, g / 1e3, buf))
            print(f"{path} ({store.mode}, {lay.expert_bytes / 2**20:.2f} MiB experts), "
                  f"{args.trials} trials of {args.reads} reads per gap:")  # fmt: skip
            base = np.array([np.median(t[1:]) for t in times[0.0]])
            for g in gaps:
                t = np.array(times[g])  # (trials, reads)
                ratio = np.median(t[:, 1:], axis=1) / base
                q1, med, q3 = np.percentile(ratio, [25, 50, 75])
                print(f"  gap {g:5.1f} ms: {1e3 * np.median(t[:, 1:]):5.2f} ms per read "
                      f"(first {1e3 * np.median(t[:, 0]):5.2f}), / back to back: {med:.2f}x "
                      f"(IQR {q1:.2f}-{q3:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
