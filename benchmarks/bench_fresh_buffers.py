"""What an uncached expert read costs when the pages it goes into were never written: reads into
fresh anonymous mappings against reads into buffers written before.

    python benchmarks/bench_fresh_buffers.py [--store results/engine_bench/bench_experts.bin]
        [--reads 16] [--trials 6]

The kernel backs a fresh allocation's pages on their first write, here the read's; on a VM
that hands freed memory back to its host that costs more (docs/measurements.md). The engine
allocates once and writes every buffer a timed read goes into where its tier is set up
(`moesub.engine.store.aligned_zeros`). Each trial reads `--reads` random whole experts through
`ExpertStore.read_into` (the engine's path) into, in turn: `--reads` buffers written before
(`written`), and a fresh anonymous mapping per read (`fresh`: `mmap`, never written; the
allocator's own reuse of freed memory would hide the first write); the order alternated per
trial, so the disk's drift falls on both. It prints each kind's median time per read and, per
trial, the fresh reads' median over the written ones': 1 is a read that does not care where it
lands. Without `--store` (or when it is missing) it writes a store of `--experts` random 6 MiB
experts into a temporary directory.
"""

from __future__ import annotations

import argparse
import mmap
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_disk_overlap import store_arguments, store_path

from moesub.engine.store import ExpertStore, StoreLayout, aligned_zeros


def fresh_buffers(lay: StoreLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's two tensors on a new anonymous mapping: page-aligned, no page written."""
    maps = [mmap.mmap(-1, nbytes) for nbytes in (lay.gate_up_bytes, lay.down_bytes)]
    return tuple(
        torch.frombuffer(m, dtype=lay.torch_dtype).view(shape)
        for m, shape in zip(maps, (lay.gate_up_shape, lay.down_shape), strict=True)
    )


def timed_reads(store: ExpertStore, flat: np.ndarray, buffers: list[tuple]) -> np.ndarray:
    """Seconds of each read of `flat` (layer-major expert indices), the j-th into buffers[j]."""
    E = store.layout.num_experts
    out = np.empty(len(flat))
    for j, i in enumerate(flat.tolist()):
        t0 = time.perf_counter()
        store.read_into(i // E, i % E, *buffers[j])
        out[j] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    store_arguments(ap, "reads per kind per trial")
    ap.add_argument("--trials", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moesub_fresh_") as tmp:
        path = store_path(args.store, Path(tmp), args.experts, args.seed)
        with ExpertStore(path) as store:
            lay = store.layout
            n, reads = (
                lay.num_layers * lay.num_experts,
                min(args.reads, lay.num_layers * lay.num_experts),
            )
            written = [
                (aligned_zeros(lay.gate_up_shape, lay.torch_dtype),
                 aligned_zeros(lay.down_shape, lay.torch_dtype))
                for _ in range(reads)
            ]  # fmt: skip
            rng = np.random.default_rng(args.seed)
            times = {"written": [], "fresh": []}  # per kind, per trial: (reads,) seconds
            for trial in range(args.trials):
                for kind in ("written", "fresh") if trial % 2 == 0 else ("fresh", "written"):
                    bufs = (
                        written if kind == "written" else [fresh_buffers(lay) for _ in range(reads)]
                    )
                    picks = rng.choice(n, size=reads, replace=False)
                    times[kind].append(timed_reads(store, picks, bufs))
            print(f"{path} ({store.mode}, {lay.expert_bytes / 2**20:.2f} MiB experts), "
                  f"{args.trials} trials of {reads} reads per kind:")  # fmt: skip
            for kind, t in times.items():
                ms = 1e3 * np.array(t)  # (trials, reads)
                print(f"  {kind:8s}: {np.median(ms):6.2f} ms per read "
                      f"(p90 {np.percentile(ms, 90):6.2f}, max {ms.max():6.1f})")  # fmt: skip
            ratio = np.median(times["fresh"], axis=1) / np.median(times["written"], axis=1)
            print(f"  fresh over written, per trial: median {np.median(ratio):.2f} "
                  f"[{ratio.min():.2f}, {ratio.max():.2f}]")  # fmt: skip


if __name__ == "__main__":
    main()
