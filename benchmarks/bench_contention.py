"""What another process on the machine does to the engine's times, and what the meter sees.

The embedded model's engine (disk -> RAM tier, the pipeline's run of `results/embedded`) decodes
the same streams under a few policies twice: alone, then beside one process that spins on a
core. Per policy it prints the time per token of both, their ratio (the slowdown), and what
`moesub.engine.contention.CpuMeter` measured of each run: the CPU share, the cores other
processes and a VM's host kept busy (`other_cores`) and the `contended` flag. A run
alone should have `other_cores` near 0 and no flag; beside the spinner, near 1 and the flag.

    PYTHONPATH=src python benchmarks/bench_contention.py [--streams 2 --tokens 128]

Needs the default run's model, capture and expert ranking (`make report`, or at least
`snakemake --cores 2 -- results/embedded/expert_ranking.parquet`). Run it with nothing else on
the machine: the first half is the baseline.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from moesub.engine.adapter import load_engine_model
from moesub.engine.spec import EngineParams
from moesub.engine.stage import PolicyRun
from moesub.policy import STUDY_POLICIES

RESULTS = "results/embedded"
POLICIES = ("all_resident", "fetch_every_miss", "host_compute")


def timed_runs(policy_run: Callable[[str], PolicyRun], loaded, streams: list[int]):
    """Each policy decodes `streams` on a fresh `PolicyRun` (its own rows and meter) on an
    engine of its own: time per token and the meter's figures, by policy."""
    out = {}
    for name in POLICIES:
        run = policy_run(name)
        run.decode(streams, progress=False, loaded=loaded)
        wall = np.concatenate([f["wall_s"].to_numpy() for f in run.frames.values()])
        out[name] = {"ms": 1e3 * float(wall.mean()), **run.meter.stop()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    params = {"max_streams": args.streams, "max_tokens": args.tokens, "progress": False}
    inputs = (f"{RESULTS}/capture/eval_tokens.parquet", f"{RESULTS}/expert_ranking.parquet")

    def policy_run(name: str) -> PolicyRun:
        policy = STUDY_POLICIES.get(name, {})
        return PolicyRun(f"{RESULTS}/model", *inputs, name, policy, 0.25, "cpu", params)

    loaded = load_engine_model(f"{RESULTS}/model", "cpu", EngineParams.from_dict(params))
    streams = list(range(args.streams))
    try:
        alone = timed_runs(policy_run, loaded, streams)
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)  # the spinner is up
            beside = timed_runs(policy_run, loaded, streams)
        finally:
            spin.kill()
            spin.wait()
    finally:
        loaded.close()
    print(f"{'policy':18s} {'alone ms':>9s} {'beside ms':>9s} {'ratio':>6s}   "
          "share alone/beside   other cores alone/beside   contended alone/beside")  # fmt: skip
    for name in POLICIES:
        a, b = alone[name], beside[name]
        print(
            f"{name:18s} {a['ms']:9.2f} {b['ms']:9.2f} {b['ms'] / a['ms']:5.2f}x   "
            f"{a['cpu_share']:.2f} / {b['cpu_share']:.2f}           "
            f"{a['other_cores']:.2f} / {b['other_cores']:.2f}                "
            f"{a['contended']} / {b['contended']}"
        )


if __name__ == "__main__":
    main()
