"""Where the disk tier's host path spends a layer: the engine bench's host runs, every token-layer
timed phase by phase.

    python benchmarks/host_path_phases.py [--params results/engine_bench/cpu.parquet]
        [--runs cal_host,host_compute,llama_cpp_27861,cal_hits] [--rounds 2]

Runs the named runs of the engine bench (its shipped parameters, read from a bench output's
metadata; its expert file is reused) on tiers of their own, as the bench does, and times in
each MoE step: the fast path (the decision to the slots' experts computed), the host's reads on
the worker (their start and end), the wait for them, and the host's compute after it. Printed
per run and per number of host experts in the layer: medians in ms, with the time per expert.
The pricing (docs/pricing.md) takes a host layer as dense + max(fast path, reads) + compute; the
phases say where that holds and where a run spends more (the fast path slowed while reads are in
flight, a wake-up after the reads, uploads reading beside the host's reads). Beside each run's
measured block (`total`), the same blocks priced: its counts layer by layer
(`price_stream_reference`'s blocks, decision to the layer's end) at the bench's fitted costs at
the run's disk (`priced`; layers without synchronous copies, which the measured block does not
hold).

The timers wrap `DiskTier.host_read`, `DiskTier.host_end` and `OffloadEngine.compute` in this
process only; nothing in the library changes.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from moesub.engine import bench
from moesub.engine.bench_runs import BenchRun, run_policy
from moesub.engine.runtime import OffloadEngine
from moesub.engine.tiers import DiskTier
from moesub.hardware import HardwareProfile, ModelBytes, UnitCosts
from moesub.io import read_metadata
from moesub.pricing import FETCH, FORCED, LayerBlock, price_stream_reference
from moesub.run_speed import AtRunDisk

PHASES = ("fast", "start", "reads", "wait", "host", "total")


class PhaseTimer:
    """Wraps the host path's three calls; `rows[run]` gets (host experts, fast experts, phases)."""

    def __init__(self) -> None:
        self.run = ""
        self.rows: dict[str, list[tuple[int, int, dict[str, float]]]] = defaultdict(list)
        self._t: dict[str, float] = {}
        read, end, compute = DiskTier.host_read, DiskTier.host_end, OffloadEngine.compute
        timer = self

        def host_read(tier, layer, host_ids):
            timer._t["r0"] = time.perf_counter()
            out = read(tier, layer, host_ids)
            timer._t["r1"] = time.perf_counter()
            return out

        def host_end(tier, job):
            timer._t["f1"] = time.perf_counter()
            job.read.result()
            timer._t["w1"] = time.perf_counter()
            return end(tier, job)

        def step(engine, layer, hidden, slot_ids, weights, host=None):
            timer._t.clear()
            d = time.perf_counter()
            out = compute(engine, layer, hidden, slot_ids, weights, host)
            e, t = time.perf_counter(), timer._t
            n_host = int((host.ids >= 0).sum()) if host is not None else 0
            n_fast = int((np.asarray(slot_ids) >= 0).sum())
            phases = {"fast": t.get("f1", e) - d, "total": e - d}
            if n_host:
                phases.update(start=t["r0"] - d, reads=t["r1"] - t["r0"],
                              wait=t["w1"] - t["f1"], host=e - t["w1"])  # fmt: skip
            timer.rows[timer.run].append((n_host, n_fast, phases))
            return out

        self._patched = [(DiskTier, "host_read", host_read), (DiskTier, "host_end", host_end),
                         (OffloadEngine, "compute", step)]  # fmt: skip
        self._saved = [(cls, name, getattr(cls, name)) for cls, name, _ in self._patched]

    def price(self, run: BenchRun, delay: int, costs: UnitCosts, skip: int) -> float:
        """Each timed block of the current run after its first `skip` gets its price; returns
        the run's priced seconds per token."""
        blocks: list[LayerBlock] = []
        priced = price_stream_reference(run.layer_counts, delay, costs, blocks)
        sync = (run.layer_counts[..., FETCH] + run.layer_counts[..., FORCED]).ravel()
        for (_h, _f, phases), b, n in zip(self.rows[self.run][skip:], blocks, sync, strict=True):
            phases["priced"] = b.end - b.decided if n == 0 else np.nan
        return priced.time_per_token_s

    def __enter__(self) -> PhaseTimer:
        for cls, name, fn in self._patched:
            setattr(cls, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


def summary(rows: list[tuple[int, int, dict[str, float]]], skip: int) -> list[str]:
    """Per number of host experts (5 layers at least): medians in ms, and per expert."""
    rows = rows[skip:]
    lines = []
    for h in sorted({r[0] for r in rows}):
        sel = [r for r in rows if r[0] == h]
        if len(sel) < 5:
            continue
        med = {p: 1e3 * float(np.median([r[2][p] for r in sel])) for p in PHASES if p in sel[0][2]}
        fast_per = 1e3 * float(np.median([r[2]["fast"] / max(r[1], 1) for r in sel]))
        text = f"  host {h}: n={len(sel):3d} fast {med['fast']:5.2f} ({fast_per:.2f}/expert)"
        if h:
            text += (f" start {med['start']:.2f} reads {med['reads']:5.2f} "
                     f"({med['reads'] / h:.2f}/expert) wait {med['wait']:5.2f} "
                     f"host {med['host']:5.2f} ({med['host'] / h:.2f}/expert)")  # fmt: skip
        priced = [r[2]["priced"] for r in sel if not np.isnan(r[2].get("priced", np.nan))]
        priced_ms = 1e3 * float(np.median(priced)) if priced else np.nan
        lines.append(text + f" total {med['total']:5.2f} priced {priced_ms:5.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="results/engine_bench/cpu.parquet",
                    help="an engine bench output: its parameters are reused")  # fmt: skip
    ap.add_argument("--runs", default="cal_host,host_compute,llama_cpp_27861,cal_hits")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    meta = read_metadata(args.params)
    params = {**meta["params"], "progress": False}
    costs = HardwareProfile.from_dict("bench", meta["profile"]).price(
        ModelBytes(meta["expert_bytes"])
    )
    at_disk = AtRunDisk.from_dict(meta["at_run_disk"]) if meta.get("at_run_disk") else None
    p = bench.BenchParams.from_dict(params)
    if p.threads:
        torch.set_num_threads(p.threads)
    plan = bench.prepare_bench(p, torch.device("cpu"), Path(args.params))
    try:
        with PhaseTimer() as timer:
            for r in range(args.rounds):
                for name in args.runs.split(","):
                    timer.run = f"{name} round {r}"
                    engine, trace, layers = plan.engine(name, plan.make_tier(plan.capacity(name)))
                    try:
                        run = run_policy(engine, trace, plan.router_w, plan.h0, p.warmup, name,
                                         False, layers)  # fmt: skip
                    finally:
                        engine.close()  # the landed copies' buffers back, then the tier
                    L = run.layer_counts.shape[1]
                    run_costs = costs if at_disk is None else at_disk.costs(costs, run.disk)
                    token_s = timer.price(run, plan.policy(name).delay, run_costs, p.warmup * L)
                    print(f"{timer.run}: {1e3 * run.wall_s.mean():.2f} ms per token (priced "
                          f"{1e3 * token_s:.2f}), {1e3 * run.disk.per_read_s:.2f} ms per read "
                          "(clock)")  # fmt: skip
                    print("\n".join(summary(timer.rows[timer.run], p.warmup * L)))
    finally:
        plan.close()


if __name__ == "__main__":
    main()
