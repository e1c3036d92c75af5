"""Expert compute against the memory-bandwidth limit: is its cost independent of the cache size?

Slot tensors of C experts of Qwen3-Next-80B-A3B's shape (hidden 2048, expert width 512, bf16,
6 MiB per expert), for C = 128 and C = 512. A decode step computes k = 10 experts for one token;
a prefill step `--prefill` tokens. Every repetition draws other random slots (the weights come
from memory, not from the CPU caches). Per path of `moesub.engine.kernels` (the one
`path_for` picks is marked) it prints the median time and the ratio to the bandwidth limit
measured in the same run: copying the same experts' bytes out of the same slot tensor
(`memcpy`, which reads them once and writes them once). A ratio near 1 means the kernel runs at
the memory bandwidth; equal times at C = 128 and C = 512 mean it does not depend on C.

    PYTHONPATH=src python benchmarks/bench_kernels.py [--threads 2 --reps 20]
    PYTHONPATH=src python benchmarks/bench_kernels.py --device cuda --reps 200   # slots on a GPU

On `--device cuda` the slot tensors live on the GPU, every timing ends with a synchronize, and
the bandwidth limit is a device-to-device copy; at decode the time is mostly kernel launches.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch
import torch.nn.functional as F

from moesub.engine.kernels import _GROUPED_MM, choose_path, expert_forward, path_for
from moesub.engine.store import aligned_empty


def median_s(fn, reps: int, sync=lambda: None) -> float:
    fn()  # warm up (allocations, thread pool)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()  # a GPU's queued kernels are part of the call's time
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacities", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=64, help="tokens of the prefill case")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="where the slots live: cpu or cuda[:i]")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    H, I, k, dt = args.hidden, args.width, args.k, torch.bfloat16
    expert_bytes = 3 * H * I * dt.itemsize
    tier_path = choose_path(dev, dt)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(
        f"{where}, {torch.get_num_threads()} CPU threads; experts {expert_bytes / 2**20:.1f} MiB "
        f"(H={H}, I={I}, bf16), k={k}; tier path {tier_path!r}; ratio = time / memcpy of the "
        "same experts' bytes"
    )
    for C in args.capacities:
        measure(C, H, I, k, args.prefill, args.reps, tier_path, expert_bytes, dev)
        gc.collect()


def measure(C: int, H: int, I: int, k: int, prefill: int, reps: int, tier_path: str,
            expert_bytes: int, dev: torch.device) -> None:  # fmt: skip
    """Print one capacity's lines: memcpy, then every kernel path, for decode and prefill."""
    dt = torch.bfloat16
    rng = np.random.default_rng(C)
    on_gpu = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if on_gpu else (lambda: None)

    def slots(shape: tuple[int, ...]) -> torch.Tensor:  # the CPU tier's are page-aligned
        return torch.empty(shape, dtype=dt, device=dev) if on_gpu else aligned_empty(shape, dt)

    gate_up, down = slots((C, 2 * I, H)), slots((C, H, I))
    for e in range(C):  # real values (untouched pages would read as shared zero pages)
        gate_up[e].normal_(0, H**-0.5)
        down[e].normal_(0, I**-0.5)
    paths = ["per_expert"] + (["grouped"] if _GROUPED_MM is not None else [])
    for N in (1, prefill):
        n_exp = min(C, k * N)  # distinct experts a call reads (at most)
        scratch_gu = torch.empty((n_exp, 2 * I, H), dtype=dt, device=dev)
        scratch_dn = torch.empty((n_exp, H, I), dtype=dt, device=dev)
        x = torch.randn(N, H).to(dev, dt)
        w = torch.full((N, k), 1.0 / k, dtype=dt, device=dev)

        def draw(N: int = N) -> np.ndarray:
            return np.stack([rng.choice(C, size=k, replace=False) for _ in range(N)])

        def memcpy(draw=draw, scratch_gu=scratch_gu, scratch_dn=scratch_dn) -> None:
            for i, e in enumerate(np.unique(draw()).tolist()):
                scratch_gu[i].copy_(gate_up[e])
                scratch_dn[i].copy_(down[e])

        copy_s = median_s(memcpy, reps, sync)
        distinct = np.mean([len(np.unique(draw())) for _ in range(20)])
        case = "decode" if N == 1 else f"prefill {N} tok"
        print(
            f"C={C:4d} {case:>15}: memcpy of ~{distinct:.0f} experts {copy_s * 1e3:7.2f} ms "
            f"({distinct * expert_bytes / copy_s / 1e9:5.1f} GB/s read)"
        )
        for path in paths:

            def run(path=path, x=x, w=w, draw=draw) -> None:
                expert_forward(x, draw(), w, gate_up, down, F.silu, path)

            t = median_s(run, reps, sync)
            mark = "*" if path == path_for(tier_path, N) else " "
            print(
                f"{'':22}{mark}{path:>10}: {t * 1e3:7.2f} ms  ratio {t / copy_s:5.2f}  "
                f"({distinct * expert_bytes / t / 1e9:5.1f} GB/s of weights)"
            )


if __name__ == "__main__":
    main()
