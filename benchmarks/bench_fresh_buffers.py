"""What an uncached expert read costs when the buffer it goes into was never written: reads into
freshly allocated buffers against reads into a buffer written before.

    python benchmarks/bench_fresh_buffers.py [--store results/engine_bench/bench_experts.bin]
        [--reads 16] [--trials 6]

The kernel backs a fresh allocation's pages on their first write; on a VM that hands freed
memory back to its host the write can cost more than the read. The engine allocates once and
writes every buffer a timed read goes into where its tier is set up
(`moesub.engine.store.aligned_zeros`). Each trial reads `--reads` random whole experts through
`ExpertStore.read_into` (the engine's path) into, in turn: one buffer written before
(`written`), a fresh `aligned_empty` buffer per read (`fresh`), and a fresh `aligned_zeros`
buffer per read (`fresh_zeroed`, its write not timed); the order rotated per trial, so the
disk's drift falls on all three. It prints each kind's median time per read and, per trial, its
median over the written buffer's: 1 is a read that does not care where it lands. Without
`--store` (or when it is missing) it writes a store of `--experts` random 6 MiB experts into a
temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_disk_overlap import store_path

from moesub.engine.store import ExpertStore, aligned_empty, aligned_zeros

KINDS = ("written", "fresh", "fresh_zeroed")


def timed_reads(store: ExpertStore, flat: np.ndarray, buffer: Callable[[], tuple]) -> np.ndarray:
    """Seconds of each read of `flat` (layer-major expert indices) into `buffer()`'s tensors."""
    E = store.layout.num_experts
    out = np.empty(len(flat))
    for j, i in enumerate(flat.tolist()):
        gu, dn = buffer()
        t0 = time.perf_counter()
        store.read_into(i // E, i % E, gu, dn)
        out[j] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=Path("results/engine_bench/bench_experts.bin"))
    ap.add_argument("--experts", type=int, default=128, help="experts of a store written here")
    ap.add_argument("--reads", type=int, default=16, help="reads per kind per trial")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moesub_fresh_") as tmp:
        path = store_path(args.store, Path(tmp), args.experts, args.seed)
        with ExpertStore(path) as store:
            lay = store.layout
            shapes, dt = (lay.gate_up_shape, lay.down_shape), lay.torch_dtype
            written = tuple(aligned_zeros(s, dt) for s in shapes)
            buffers = {
                "written": lambda: written,
                "fresh": lambda: tuple(aligned_empty(s, dt) for s in shapes),
                "fresh_zeroed": lambda: tuple(aligned_zeros(s, dt) for s in shapes),
            }
            n = lay.num_layers * lay.num_experts
            rng = np.random.default_rng(args.seed)
            times = {kind: [] for kind in KINDS}  # per kind, per trial: (reads,) seconds
            for trial in range(args.trials):
                for kind in np.roll(KINDS, trial).tolist():
                    picks = rng.choice(n, size=min(args.reads, n), replace=False)
                    times[kind].append(timed_reads(store, picks, buffers[kind]))
            print(f"{path} ({store.mode}, {lay.expert_bytes / 2**20:.2f} MiB experts), "
                  f"{args.trials} trials of {args.reads} reads per kind:")  # fmt: skip
            base = np.array([np.median(t) for t in times["written"]])
            for kind in KINDS:
                t = np.array(times[kind])  # (trials, reads)
                ratio = np.median(t, axis=1) / base
                print(f"  {kind:12s}: {1e3 * np.median(t):6.2f} ms per read (p90 "
                      f"{1e3 * np.percentile(t, 90):6.2f}), over written: median "
                      f"{np.median(ratio):.2f} [{ratio.min():.2f}, {ratio.max():.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
