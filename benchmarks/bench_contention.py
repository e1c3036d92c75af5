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

import numpy as np

from moesub.engine.adapter import load_engine_model
from moesub.engine.contention import CpuMeter
from moesub.engine.stage import PolicyRun
from moesub.policy import STUDY_POLICIES

RESULTS = "results/embedded"
POLICIES = ("all_resident", "fetch_every_miss", "host_compute")


def timed_runs(runs: dict[str, PolicyRun], loaded, streams: list[int]) -> dict[str, dict]:
    """Each run decodes `streams` on an engine of its own: time per token and the meter's
    figures."""
    out = {}
    for name, run in runs.items():
        run.frames.clear()
        run.meter = CpuMeter()  # one measurement, one meter
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
    runs = {
        name: PolicyRun(
            f"{RESULTS}/model", *inputs, name, STUDY_POLICIES.get(name, {}), 0.25, "cpu", params
        )
        for name in POLICIES
    }
    loaded = load_engine_model(f"{RESULTS}/model", "cpu", next(iter(runs.values())).spec.opts)
    streams = list(range(args.streams))
    try:
        alone = timed_runs(runs, loaded, streams)
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)  # the spinner is up
            beside = timed_runs(runs, loaded, streams)
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
