"""Where a decode token's time goes on the engine bench's tier: kernels, launches, copies, waits.

    python benchmarks/profile_decode.py --device cuda [--layers 4 --tokens 64]
        [--runs all_resident,cal_hits,fetch_every_miss,host_compute]

Builds the engine bench's runs (its shapes and routing: `moesub.engine.bench`, synthetic router
decisions unless `--trace-dir` holds a capture) and decodes each twice: once plain, for its time
per token, and once under `torch.profiler`. Printed per run and per token: the wall time, the
fast device's busy time (the union of its kernels' and copies' intervals), the kernel launches,
host -> device copies and host waits (stream / event synchronizations) the host issued, and the
operators that took the most host time. Where the device is busy for a small part of the wall
time and the launches are many, the decode is bound by the host issuing work, not by the
weights' bytes (docs/hardware.md, "moesub's CUDA tier"). On `--device cpu` only the host side
is profiled (the disk tier).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moesub.engine import bench
from moesub.engine.bench_runs import run_policy
from moesub.engine.tiers import require_cuda

HOST_CALLS = {  # CUDA runtime / driver calls by what they do, as the profiler names them
    "launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"),
    "copies": ("cudaMemcpyAsync", "cudaMemcpy"),
    "waits": ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
              "cudaStreamWaitEvent"),
}  # fmt: skip


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, in their unit."""
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile_run(plan, name: str, warmup: int) -> dict[str, float | list[tuple[str, float]]]:
    """One run decoded plain and then under the profiler; figures per decoded token."""

    def decode(prof: profile | None = None) -> tuple[int, float]:
        """Tokens decoded (warmup included) and the median measured time per token, in ms; the
        engine is built (its slots loaded) before the profiler starts."""
        engine, trace, layers = plan.engine(name, plan.make_tier(plan.capacity(name)))
        try:
            if prof is not None:
                prof.start()
            run = run_policy(engine, trace, plan.router_w, plan.h0, warmup, name, False, layers)
            if prof is not None:
                prof.stop()
        finally:
            engine.close()
        return trace.shape[0], 1e3 * float(np.median(run.wall_s))

    _, plain_ms = decode()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.dev.type == "cuda" else [])
    prof = profile(activities=acts)
    tokens, profiled_ms = decode(prof)  # every token, warmup included, is in the profile
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    calls = Counter(e.name for e in events if e.device_type == DeviceType.CPU)
    per = {k: sum(calls[n] for n in names) / tokens for k, names in HOST_CALLS.items()}
    host_ops = Counter()
    for avg in prof.key_averages():
        if avg.device_type == DeviceType.CPU and not avg.key.startswith(("cuda", "cu")):
            host_ops[avg.key] += avg.self_cpu_time_total / tokens
    return {
        "wall_ms": plain_ms,
        "profiled_wall_ms": profiled_ms,
        "device_busy_ms": busy_us([(e.time_range.start, e.time_range.end) for e in device])
        / 1e3
        / tokens,
        "device_ops": len(device) / tokens,
        **per,
        "top_host_ops": [(k, v / 1e3) for k, v in host_ops.most_common(8)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--runs", default="all_resident,cal_hits,fetch_every_miss,host_compute")
    ap.add_argument("--trace-dir", default=None, help="a capture directory: route by its trace")
    ap.add_argument("--work", type=Path, default=None, help="scratch (the disk tier's file)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="moesub_profile_"))
    p = bench.BenchParams.from_dict({
        "layers": args.layers, "tokens": args.tokens, "warmup": args.warmup, "rounds": 1,
        "routing": "trace" if args.trace_dir else "synthetic", "trace_dir": args.trace_dir,
        "store_path": str(work / "experts.bin"), "progress": False,
    })  # fmt: skip
    dev = require_cuda(args.device)
    plan = bench.prepare_bench(p, dev, work / "profile.parquet")
    print(f"{args.device}: {p.layers} layers, C={p.capacity} of {p.num_experts}, top-{p.top_k}, "
          f"{p.layout().expert_bytes / 2**20:.1f} MiB experts, routing {plan.logits.source}; "
          "per token (the profile's counts over every decoded token, warmup included)")  # fmt: skip
    try:
        for name in args.runs.split(","):
            r = profile_run(plan, name, p.warmup)
            line = f"\n{name}: wall {r['wall_ms']:.2f} ms ({r['profiled_wall_ms']:.2f} profiled)"
            if dev.type == "cuda":
                line += (
                    f", device busy {r['device_busy_ms']:.2f} ms "
                    f"({r['device_busy_ms'] / r['profiled_wall_ms']:.0%} of the profiled wall), "
                    f"{r['device_ops']:.0f} device ops, {r['launches']:.0f} launches, "
                    f"{r['copies']:.0f} copies, {r['waits']:.0f} waits"
                )
            print(line + "; host time by operator:")
            for op, ms in r["top_host_ops"]:
                print(f"  {ms:7.3f} ms  {op}")
    finally:
        plan.close()


if __name__ == "__main__":
    main()
