"""Real-size engine benchmark: time per token of the study's policies, as ratios, in ONE run.

Qwen3-Next-80B-A3B expert shapes (hidden 2048, expert width 512, 512 experts per layer, top-10,
bf16 = 6 MiB per expert), random weights, the embedded model's captured router trace mapped
onto the benchmark's layers (`--routing trace`, `moesub.engine.bench_inputs`; the pipeline's
`results/embedded/capture/` by default) or synthetic router decisions (`--routing synthetic`),
C = 25% = 128 slots per layer, `--layers` MoE layers. On `--device cpu` the slow tier is an
expert file on disk read with O_DIRECT (the page cache bypassed) and the fast tier RAM; on
`--device cuda` pinned host memory and the GPU. Prints the table (speedups of every policy vs
fetch_every_miss and vs host_compute, measured in the same run), the measured link bandwidth, the
machine's profile fitted to this run's calibration runs and its error against every policy's time
per token (its mean over the interleaved rounds, each running a share of its tokens), and the
machine's load; writes the Parquet table to `--out`.

    PYTHONPATH=src python benchmarks/bench_engine.py [--device cpu --layers 2 --tokens 200]
    python benchmarks/bench_engine.py --quick   # small shapes, seconds: a smoke run

The expert file (layers x 3 GiB) is kept beside `--out` for reuse (`--store` to move it,
`--delete-store` to remove it afterwards). The reference study's GPU figure for speed/quality
vs fetch_every_miss was 2.5-3.0x.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from moesub.engine import run_benchmark
from moesub.io import read_metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200, help="measured tokens per policy")
    ap.add_argument("--warmup", type=int, default=16, help="unrecorded, before each round's share")
    ap.add_argument("--rounds", type=int, default=8, help="each runs a share of the tokens")
    ap.add_argument("--routing", choices=["trace", "synthetic"], default="trace")
    ap.add_argument("--trace-dir", default="results/embedded/capture", help="capture directory")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/engine_bench.parquet"))
    ap.add_argument("--store", type=Path, default=None, help="expert file (default beside --out)")
    ap.add_argument("--delete-store", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument(
        "--quick", action="store_true", help="small experts (E=64, H=256, I=64, top-4), 32 tokens"
    )
    args = ap.parse_args()
    quick = {"num_experts": 64, "hidden": 256, "width": 64, "top_k": 4, "calib_tokens": 512}
    if args.quick:
        args.tokens, args.warmup, args.rounds = 32, 4, 1

    tag = "quick" if args.quick else "L"
    store = args.store or args.out.parent / f"bench_experts_{tag}{args.layers}.bin"
    params = {
        "layers": args.layers,
        "tokens": args.tokens,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "routing": "synthetic" if args.quick else args.routing,
        "trace_dir": args.trace_dir,
        "threads": args.threads,
        "store_path": str(store),
        "progress": not args.quiet,
        **(quick if args.quick else {}),
    }
    try:
        df = run_benchmark(params, args.device, args.out)
    finally:
        if args.delete_store:
            store.unlink(missing_ok=True)
            store.with_name(store.name + ".lock").unlink(missing_ok=True)
    meta = read_metadata(args.out)
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(200)
    pl.Config.set_float_precision(4)
    print(f"\n{meta['tier']}")
    print(
        f"layers={args.layers}, C={meta['capacity']} of {meta['params']['num_experts']} per "
        f"layer, expert "
        f"{meta['expert_bytes'] / 2**20:.1f} MiB, {meta['threads']} CPU threads, "
        f"{args.tokens} tokens x {args.rounds} rounds per policy"
    )
    if "disk_read_bandwidth_Bps" in meta:
        print(
            f"disk read bandwidth ({meta['store_mode']}, expert-sized reads): "
            f"{meta['disk_read_bandwidth_Bps'] / 1e9:.2f} GB/s, 4 KiB read latency "
            f"{meta['disk_read_latency_s'] * 1e6:.0f} us"
        )
    u = meta["unit_costs"]  # this machine's profile fitted to the run, priced for its experts
    print(f"routing: {meta['routing']}")
    print(
        f"this_machine (fitted on {meta['cost_fit']['kept']} calibration tokens): copy "
        f"{u['copy_s'] * 1e6:.0f} us, expert {u['expert_s'] * 1e6:.0f} us, host expert "
        f"{u['host_expert_s'] * 1e6:.0f} us, dense/layer {u['dense_layer_s'] * 1e6:.0f} us, "
        f"per token {u['token_overhead_s'] * 1e6:.0f} us, install {u['install_s'] * 1e6:.0f} us"
    )
    print(f"load average (1, 5, 15 min): {meta['load_avg_start']} -> {meta['load_avg_end']}")
    cols = [
        "policy", "time_per_token_median_s", "time_per_token_mean_s", "fetch_wait_s",
        "hit_rate", "sub_rate", "speedup_vs_fetch_every_miss", "speedup_vs_host_compute",
        "syncs_per_token", "admit_latency_tokens", "est_time_per_token_s", "sim_rel_error",
    ]  # fmt: skip
    print(df.select(cols))


if __name__ == "__main__":
    main()
