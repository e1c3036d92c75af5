"""A Qwen3-Next-sized RTRACE01 trace read and simulated in bounded memory.

Writes a 48-layer x 512-expert x 100,000-token RTRACE01 file with full probabilities (9.8 GB;
the free disk is checked first) to a temporary directory, deleted afterwards. The trace is
`moesub.synthetic.synthetic_logits` in segments of 1,000 tokens, each its own draw (seed = the
segment: its own popularity and topics). Then each phase runs in a fresh process and prints the
wall time of its work (imports apart) and the process's peak RSS (VmHWM, imports included):

  raw       one sequential read of the file into a 64 MiB buffer: the baseline throughput
  check     `open_trace`: the checking pass (every record's numbers and probabilities)
  simulate  `open_trace` + `simulate_trace` (chunks of 1,024 tokens, 2 threads) of
            fetch_every_miss, rule_015 and speed at 25% (C = 128), initial experts 0..C-1

Target: the simulate phase's peak RSS <= 4 GiB. Times are also given relative to the raw read.

    nice python benchmarks/bench_traces.py [--tokens 100000] [--layers 48] [--experts 512]
        [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

K, SEGMENT, FRACTION = 10, 1000, 0.25
POLICIES = {
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "rule_015": {"rule": "threshold", "tau": 0.15, "eviction": "lru"},
    "speed": {"rule": "first_choice", "eviction": "lfu", "beta": 0.5},
}


def write_file(path: Path, tokens: int, layers: int, experts: int) -> None:
    from moesub.synthetic import synthetic_logits
    from moesub.traces import TraceWriter

    with TraceWriter(path, "rtrace01", experts) as w:
        for i, t0 in enumerate(range(0, tokens, SEGMENT)):
            w.write(logits=synthetic_logits(min(SEGMENT, tokens - t0), layers, experts, seed=i))


def phase_raw(path: Path) -> dict:
    import numpy as np

    buf = np.empty(64 << 20, np.uint8)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return {"bytes": total}


def phase_check(path: Path) -> dict:
    from moesub.traces import open_trace

    f = open_trace(path, "rtrace01", top_k=K)
    return {"tokens": f.num_tokens, "layers": f.num_layers, "experts": f.num_experts}


def phase_simulate(path: Path) -> dict:
    from moesub.grid import GridPoint
    from moesub.policy import Policy
    from moesub.traces import open_trace, simulate_trace

    f = open_trace(path, "rtrace01", top_k=K)
    t0 = time.perf_counter()
    E = f.num_experts
    grid = [GridPoint.at_fraction(n, Policy.from_dict(p), FRACTION, E) for n, p in POLICIES.items()]
    table = simulate_trace(f, grid, chunk_tokens=1024, n_threads=2)
    out = {"simulate_s": time.perf_counter() - t0}
    for name in POLICIES:
        rows = table.filter(table["policy"] == name).sort("layer")
        out[name] = {
            "hit_rate": rows.filter(rows["layer"] == -1)["hit_rate"].item(),
            "hits_per_layer": rows.filter(rows["layer"] >= 0)["hit"].to_list(),
        }
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM, which starts afresh at exec (ru_maxrss
    keeps the forking parent's peak across exec on Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_phase(name: str, path: Path) -> dict:
    """One phase in a fresh interpreter: its result, wall time and peak RSS."""
    cmd = [sys.executable, __file__, "--phase", name, "--path", str(path)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--phase", choices=("raw", "check", "simulate"), help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        import moesub.grid  # noqa: F401  imports outside the timed work
        import moesub.traces  # noqa: F401

        t0 = time.perf_counter()
        result = {"raw": phase_raw, "check": phase_check, "simulate": phase_simulate}[args.phase](
            args.path
        )
        result["wall_s"] = time.perf_counter() - t0
        result["peak_rss_gib"] = peak_rss_bytes() / 2**30
        print(json.dumps(result))
        return
    size = 16 + args.tokens * args.layers * (8 + 4 * args.experts)
    free = shutil.disk_usage(args.dir).free
    if free < size + (4 << 30):
        sys.exit(
            f"{args.dir}: {free / 1e9:.1f} GB free, the trace needs {size / 1e9:.1f} GB + 4 GiB"
        )
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_traces.") as d:
        path = Path(d) / "trace.rtrace01"
        t0 = time.perf_counter()
        write_file(path, args.tokens, args.layers, args.experts)
        print(
            f"trace: T={args.tokens} L={args.layers} E={args.experts} k={K}: "
            f"{path.stat().st_size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s"
        )
        runs = {name: run_phase(name, path) for name in ("raw", "check", "simulate")}
    raw = runs["raw"]["wall_s"]
    for name, r in runs.items():
        print(
            f"{name:9s} wall {r['wall_s']:7.1f} s ({r['wall_s'] / raw:5.2f}x raw read)  "
            f"peak RSS {r['peak_rss_gib']:.2f} GiB"
        )
    print(f"raw read: {size / raw / 1e9:.2f} GB/s")
    sim = runs["simulate"]
    print(f"simulate pass alone: {sim['simulate_s']:.1f} s; peak RSS target 4 GiB: "
          f"{'met' if sim['peak_rss_gib'] <= 4 else 'MISSED'}")  # fmt: skip
    for name in POLICIES:
        r = sim[name]
        print(f"{name}: hit rate {r['hit_rate']:.4f}; hits per layer {r['hits_per_layer']}")


if __name__ == "__main__":
    main()
