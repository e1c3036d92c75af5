"""How steady a token's expert compute is with one torch thread and with a team of several: the
spread of its time over short windows, the two alternated in one process.

    python benchmarks/bench_compute_threads.py [--threads 2] [--windows 40] [--window-s 1]

The engine benchmark's pricing error is read against the spread of its rounds over their price
(`round_spread`), and its runs compute with `engine.bench.threads` torch threads. This computes
top-k experts of the bench's size (Qwen3-Next-80B-A3B: H=2048, expert width 512, bf16, 6 MiB)
through the engine's kernel (`moesub.engine.kernels.expert_forward`) over a pool of experts
larger than the caches, in windows of `--window-s` alternating one thread and `--threads`,
and prints each window's median time per token-layer and, per thread count, the spread of the
windows (p90 / p10, and max / min): 1.0 is a machine whose speed does not move. On a 2-vCPU
VM (2026-12-05) a team of two ran at two speeds about 35% apart, and one thread in the same
process was steadier in most runs (docs/measurements.md; the cause was not measured).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from moesub.engine.kernels import expert_forward

H, WIDTH, POOL = 2048, 512, 96  # the bench's expert shapes; 96 x 6 MiB = 576 MiB of experts


def window_median(threads: int, seconds: float, k: int, state: dict) -> float:
    """Median seconds per token-layer (k experts of the pool, the next k each time) over
    `seconds` with `threads` torch threads."""
    torch.set_num_threads(threads)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        ids = (state["next"] + np.arange(k)) % POOL
        state["next"] = int(ids[-1]) + 1
        t0 = time.perf_counter()
        expert_forward(state["h"], ids[None], state["w"], state["gate_up"], state["down"],
                       torch.nn.functional.silu)  # fmt: skip
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="the team's size (against one)")
    ap.add_argument("--windows", type=int, default=40, help="windows of each thread count")
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=10)
    args = ap.parse_args()
    if args.threads < 2 or args.windows < 2:
        raise SystemExit("--threads and --windows must be at least 2")
    g = torch.Generator().manual_seed(0)
    state = {
        "gate_up": torch.randn(POOL, 2 * WIDTH, H, generator=g).to(torch.bfloat16),
        "down": torch.randn(POOL, H, WIDTH, generator=g).to(torch.bfloat16),
        "h": torch.randn(1, H, generator=g).to(torch.bfloat16),
        "w": torch.full((1, args.top_k), 1 / args.top_k, dtype=torch.bfloat16),
        "next": 0,
    }
    caller = torch.get_num_threads()
    medians: dict[int, list[float]] = {1: [], args.threads: []}
    try:
        for _ in range(args.windows):
            for n in medians:
                medians[n].append(window_median(n, args.window_s, args.top_k, state))
    finally:
        torch.set_num_threads(caller)
    for n, ms in medians.items():
        m = np.array(ms) * 1e3
        p10, p50, p90 = np.percentile(m, [10, 50, 90])
        print(f"{n} thread(s): median {p50:.2f} ms per token-layer, p90/p10 {p90 / p10:.2f}, "
              f"max/min {m.max() / m.min():.2f}")  # fmt: skip
        print("  windows (ms):", " ".join(f"{v:.2f}" for v in m))
    one, team = (np.median(medians[n]) for n in medians)
    print(f"team of {args.threads} against one thread: {one / team:.2f}x as fast (medians)")


if __name__ == "__main__":
    main()
