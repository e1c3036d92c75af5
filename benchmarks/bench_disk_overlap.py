"""How much two threads reading experts at once gain over one: the disk tier's overlap.

    python benchmarks/bench_disk_overlap.py [--store results/engine_bench/bench_experts.bin]
        [--reads 16] [--pairs 20]

On the disk tier the host's worker reads the experts the host computes while the I/O thread
reads uploads and admissions (`moesub.engine.tiers`); the pricing queues both on one link
(docs/pricing.md, "One FIFO link"). This times, in alternating trials, `--reads` random
whole-expert reads by one thread, then as many by each of two threads at once, through
`ExpertStore.read_into` (the engine's path: `O_DIRECT` where the file allows) on one shared
store, and prints the bytes per second of each and their ratio (1: the disk serves one read at a
time, as one queue prices it; 2: two reads cost no more than one). Without `--store` (or when
it is missing) it writes a store of `--experts` random 6 MiB experts into a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from moesub.engine.store import (
    ExpertStore,
    StoreLayout,
    aligned_empty,
    open_or_write_store,
    random_experts,
)


def timed_reads(store: ExpertStore, picks: list[np.ndarray]) -> float:
    """Each thread reads its own experts (`picks[i]`: flat indices) into its own buffers, all
    threads at once; the seconds until the last is done."""
    lay = store.layout
    bufs = [
        (aligned_empty(lay.gate_up_shape, lay.torch_dtype), aligned_empty(lay.down_shape,
                                                                          lay.torch_dtype))
        for _ in picks
    ]  # fmt: skip
    start = threading.Barrier(len(picks) + 1)

    def read(mine: np.ndarray, buf: tuple) -> None:
        start.wait()
        for i in mine.tolist():
            store.read_into(i // lay.num_experts, i % lay.num_experts, *buf)

    threads = [threading.Thread(target=read, args=a) for a in zip(picks, bufs, strict=True)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def store_arguments(ap: argparse.ArgumentParser, reads_help: str) -> None:
    """The disk benchmarks' shared options: the store, its size where written here, the reads
    per trial and the seed."""
    ap.add_argument("--store", type=Path, default=Path("results/engine_bench/bench_experts.bin"))
    ap.add_argument("--experts", type=int, default=128, help="experts of a store written here")
    ap.add_argument("--reads", type=int, default=16, help=reads_help)
    ap.add_argument("--seed", type=int, default=0)


def store_path(path: Path, tmp: Path, experts: int, seed: int) -> Path:
    """`path` where it exists, else a store of `experts` random real-size experts (one layer,
    6 MiB each) written into `tmp`."""
    if path.exists():
        return path
    lay = StoreLayout(1, experts, 2048, 512, "bfloat16")
    path = tmp / "experts.bin"
    open_or_write_store(path, lay, random_experts(lay, seed)).close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    store_arguments(ap, "reads per thread per trial")
    ap.add_argument("--pairs", type=int, default=20, help="trials of one thread, then two")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moesub_overlap_") as tmp:
        path = store_path(args.store, Path(tmp), args.experts, args.seed)
        with ExpertStore(path) as store:
            lay = store.layout
            n = lay.num_layers * lay.num_experts
            rng = np.random.default_rng(args.seed)
            one, two = [], []
            for _ in range(args.pairs):
                picks = rng.choice(n, size=3 * args.reads, replace=False)
                first, second, third = np.split(picks, 3)
                one.append(args.reads / timed_reads(store, [first]))
                two.append(2 * args.reads / timed_reads(store, [second, third]))
            mib = lay.expert_bytes / 2**20
            ratio = np.array(two) / np.array(one)
            q1, med, q3 = np.percentile(ratio, [25, 50, 75])
            print(f"{path} ({store.mode}, {mib:.2f} MiB experts), {args.pairs} trials of "
                  f"{args.reads} reads per thread:")  # fmt: skip
            print(f"  one thread  {np.median(one) * mib:8.1f} MiB/s (median)")
            print(f"  two threads {np.median(two) * mib:8.1f} MiB/s (median, both together)")
            print(f"  two / one, per trial: median {med:.2f}x (IQR {q1:.2f}-{q3:.2f})")


if __name__ == "__main__":
    main()
