"""The engine's calibration: `this_machine`'s hardware profile, fitted to timed engine runs.

`calibrate` times the real engine on the model, on the calibration streams, under one mechanism per
run (`MECHANISMS`: every expert resident, so every one a hit; every miss fetched; every miss
computed by the host; background admissions), in interleaved rounds (`round_order`) so that the
machine's load falls on all alike, each run on an engine of its own. Every token's wall time and
per-token-layer counts feed the non-negative fit of the pricing's terms (`moesub.calibration`; on
the disk tier each run's copies are taken at the disk's speed while it read, and the disk's speed
from the median copy run, `COPY_RUN`; where the host reads its experts over the link, the host's
terms come from the pricing of the host runs); the fast tier's expert time is a microbenchmark
(`measure_expert_compute`, on loaded slots) that splits the fitted per-layer constant, and so
are its slowdowns while the link reads (`measure_host_read_drag`,
`measure_background_read_drag`: the disk tier) and its install of a landed copy
(`measure_install`), all four taken after up to `MICRO_RUNS` runs of each C-slot tier spread over
the rounds and their medians used (`microbenchmarks`). The output JSON holds the profile
(`moesub.hardware.measured_profile`: `moesub.hardware.this_machine` reads it), the seconds it was
made from, what pricing a run at the disk's speed while it read needs (`at_run_disk`:
`moesub.run_speed.AtRunDisk`), the fit, each mechanism's runs priced at the profile against
their time (`run_errors`: the fit's error on its own runs) and the runs' CPU share
(`moesub.engine.contention`).

On the disk->RAM tier the "link" is the disk read path (page cache bypassed) and a host
expert's time includes the fresh disk read it costs there; on CUDA the link is pinned host ->
GPU memory. The real-size benchmark (`moesub.engine.bench`) fits the same way.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl
import torch

from moesub.calibration import TimedTokens, fit_unit_costs, run_errors, unit_costs_from_fit
from moesub.engine.adapter import LoadedModel, load_engine_model
from moesub.engine.contention import CpuMeter
from moesub.engine.copies import COPY_TIMEOUT_S, POLL_S
from moesub.engine.generate import EngineModel
from moesub.engine.kernels import expert_forward
from moesub.engine.spec import EngineParams, resolve_engine
from moesub.engine.tiers import DiskTier, disk_clock
from moesub.hardware import ModelBytes, measured_profile
from moesub.io import require_file, write_json
from moesub.policy import ALL_RESIDENT, Policy
from moesub.run_speed import AtRunDisk, DiskClock, reference_clock

T = TypeVar("T")

# the calibration's runs, one mechanism each; the hits run is every expert resident (C = E).
# cal_admit's beta 0.1 admits ~1.8 experts per token on the bench's calibration tokens (beta
# 0.5: ~0.09): the fit's own install term keeps those tokens from pulling its other terms
MECHANISMS: dict[str, dict[str, Any] | None] = {
    "cal_hits": None,
    "cal_fetch": {"rule": "fetch_all", "eviction": "lru"},
    "cal_host": {"rule": "host_compute", "eviction": "lru"},
    "cal_admit": {"rule": "first_choice", "eviction": "lfu", "beta": 0.1},
}
MECHANISM_DELAYS = {
    name: Policy.from_dict(policy).delay for name, policy in MECHANISMS.items() if policy
}
# the mechanisms whose runs find the host's terms, and the background lane's start, through the
# pricing where the host reads over the link; and the one whose reads are the synchronous copies
# the copy term prices: its median run is the disk's reference speed (`reference_clock`). The
# host's reads, beside the slots' compute, ran 2-14% faster than the copies on 2026-12-05 and
# 1.3-1.6x their time on 2026-12-06 (docs/measurements.md): pooled, they moved the copies' price
HOST_RUN, ADMIT_RUN, COPY_RUN = "cal_host", "cal_admit", "cal_fetch"
# alternations of each drag microbenchmark after a run (some 0.8 s for both at 2): the median
# over the calibration's runs does the rest
DRAG_ROUNDS = 2
# runs of each C-slot mechanism that the microbenchmarks follow, spread over the rounds (every
# run up to this many rounds): some 0.8 s each on the embedded model, beside 16 short rounds
MICRO_RUNS = 4


def timeit(fn: Callable[[], Any], sync: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `reps` runs (after `warmup`), synchronized."""
    for _ in range(warmup):  # synchronized too: a run may reuse the last one's pinned buffers
        fn()
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def expert_step(tier, k: int, seed: int = 0) -> Callable[[], None]:
    """One decode step's k experts for one token from fast-tier slots, each call k other random
    slots of those that hold an expert, so weights come from memory as in decoding, not from
    cache. Slots never written hold zeros: on the CPU their pages are unmapped, so the first
    reads fault them in and later ones read one shared zero page from cache (the engine bench
    once timed 0.48 ms so, against 0.44 ms on loaded slots and 0.21 ms on the zero page): they
    are not used."""
    s = tier.slots[0]
    loaded = loaded_slots(tier, k)
    g = torch.Generator().manual_seed(seed)
    H = s.gate_up.shape[-1]
    x = torch.randn(1, H, generator=g).to(device=s.gate_up.device, dtype=s.gate_up.dtype)
    rng = np.random.default_rng(seed)
    sets = itertools.cycle([rng.choice(loaded, size=k, replace=False).reshape(1, k)
                            for _ in range(64)])  # fmt: skip
    w = torch.full((1, k), 1.0 / k, device=x.device, dtype=x.dtype)

    def step() -> None:
        expert_forward(
            x, next(sets), w, s.gate_up, s.down, tier.act, tier.path, lambda a: tier.upload(0, a)
        )

    return step


def loaded_slots(tier, k: int) -> np.ndarray:
    """The slots of layer 0 that hold an expert (not all zero), at least k of them."""
    s = tier.slots[0]
    if s.capacity < k:
        raise ValueError(f"capacity {s.capacity} < k={k}")
    loaded = np.flatnonzero(s.gate_up[:, 0].ne(0).any(dim=-1).cpu().numpy())  # [C] -> ids
    if len(loaded) < k:
        raise ValueError(
            f"expert microbenchmark: {len(loaded)} of layer 0's {s.capacity} slots hold an "
            f"expert (the rest are all zero), fewer than k={k}: load the tier's slots first"
        )
    return loaded


def measure_expert_compute(tier, k: int, reps: int = 10, seed: int = 0) -> float:
    """Seconds to compute one expert for one token from fast-tier slots: the median over `reps`
    steps of k experts (`expert_step`), / k."""
    return timeit(expert_step(tier, k, seed), tier.synchronize, reps) / k


def mean_step_s(step: Callable[[], None], sync: Callable[[], None], min_s: float) -> float:
    """Mean seconds of `step()` over as many calls as fill `min_s` (at least 3), synchronized."""
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < min_s:
        step()
        n += 1
    sync()
    return (time.perf_counter() - t0) / n


def alternated_drag(
    time_alone: Callable[[], float], time_beside: Callable[[], float], rounds: int
) -> float:
    """A drag as a fraction: mean step times alone and beside some reads (`mean_step_s`),
    alternated `rounds` times; the ratio of the medians less 1, at least 0."""
    alone, beside = [], []
    for _ in range(rounds):
        alone.append(time_alone())
        beside.append(time_beside())
    return max(0.0, float(np.median(beside) / np.median(alone)) - 1.0)


def measure_host_read_drag(
    tier, k: int, rounds: int = 5, min_s: float = 0.1, seed: int = 0
) -> float:
    """How much slower the fast tier computes its experts while the host's reads are in flight,
    as a fraction (`UnitCosts.host_read_drag`): steps of k experts (`expert_step`) timed alone
    and while a thread reads experts the way the host does (`tier.host_read`, fresh from disk,
    two at a time), each timing the mean over `min_s` seconds of steps (`alternated_drag`).
    Means, not medians of single steps: on the embedded model, whose step takes 0.3 ms, the
    median of 10 steps swung from 0.8 to 2.8 between calls (the slowdown falls on some short
    steps and not others; the reader's hold on the GIL is the likely cause, not isolated). On
    the disk tier the reads take CPU time and memory bandwidth from the slots' experts
    (0.42-0.45 ms per expert alone against 0.49-0.68 beside the reads in the engine bench's host
    runs, docs/measurements.md). The CUDA tier's GPU computes beside its host's reads: 0."""
    if not isinstance(tier, DiskTier):
        return 0.0
    E = tier.layout.num_experts
    step = expert_step(tier, k, seed)
    reading, stop = threading.Event(), threading.Event()

    def read_loop() -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                ids = rng.choice(E, size=(1, min(2, k)), replace=False)
                reading.set()
                tier.host_read(0, ids)
        finally:
            reading.set()  # a reader that failed wakes the timing up; its result raises

    with ThreadPoolExecutor(1, thread_name_prefix="moesub-drag-reads") as pool:

        def beside_reads() -> float:
            reading.clear()
            stop.clear()
            reader = pool.submit(read_loop)
            try:
                reading.wait()  # the first read is under way before the timing starts
                return mean_step_s(step, tier.synchronize, min_s)
            finally:
                stop.set()
                reader.result()

        return alternated_drag(lambda: mean_step_s(step, tier.synchronize, min_s),
                               beside_reads, rounds)  # fmt: skip


def measure_background_read_drag(
    tier, k: int, rounds: int = 5, min_s: float = 0.1, seed: int = 0
) -> float:
    """How much slower the fast tier computes its experts while the I/O thread reads background
    copies (admissions, uploads, prefetches), as a fraction (`UnitCosts.background_read_drag`):
    steps of k experts (`expert_step`) timed alone and with the I/O thread kept reading one
    expert after another, fed between steps by the timing thread as the engine's main thread
    feeds it (`BackgroundReader.submit`; landed buffers released), each the mean step time over
    `min_s` seconds (`alternated_drag`). Apart from the host's reads' drag: the I/O thread reads
    one expert at a time, fresh from disk, where the host's worker reads its experts back to
    back (on this machine, 2026-12-03: 0.77-0.83 against 1.12-1.17 on three small user
    checkpoints, 1.82 against 2.06 on the embedded model, 0.147 against 0.114 in an engine
    bench). 0 off the disk tier. Nothing may be in flight on the tier's reader, nor its buffers
    held (an engine's: `OffloadEngine.reset`)."""
    if not isinstance(tier, DiskTier):
        return 0.0
    E, reader = tier.layout.num_experts, tier.reader
    step = expert_step(tier, k, seed)
    depth = min(2, len(reader.buffers))  # a read queued behind the one in flight
    rng = np.random.default_rng(seed)
    queued = 0

    def fed_step() -> None:
        nonlocal queued
        for _expert, idx, _bytes in reader.poll(0):
            reader.release(idx)
            queued -= 1
        while queued < depth:
            reader.submit(0, int(rng.integers(E)))
            queued += 1
        step()

    def beside_reads() -> float:
        nonlocal queued
        out = mean_step_s(fed_step, tier.synchronize, min_s)
        reader.drain()  # the reads left in flight, their buffers released
        queued = 0
        return out

    return alternated_drag(lambda: mean_step_s(step, tier.synchronize, min_s),
                           beside_reads, rounds)  # fmt: skip


def measure_install(tier, reps: int = 8, seed: int = 0) -> float:
    """Seconds the fast tier takes to install one landed background copy
    (`UnitCosts.install_s`): the median over `reps` copies, each requested (a random expert of
    layer 0), waited for until it has landed, then installed into a random slot that holds an
    expert (`tier.install`, synchronized). Each install copies a staging buffer the read has
    just written, as in decoding: on the disk tier the engine bench's runs installed in 0.41 ms
    (median, ad hoc), where one buffer copied again and again took 0.29 ms from the caches.
    Timed alone: the pricing slows it by the background copies' drag while the link reads (found
    through the pricing of the admission runs instead, it followed their spread:
    docs/pricing.md). The slots it fills no longer hold what the engine's residency says: taken
    after a run, on a tier nothing decodes on again, with nothing in flight."""
    slots = loaded_slots(tier, 1)
    E = tier.layout.num_experts
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(reps):
        tier.request(0, int(rng.integers(E)))
        t0 = time.perf_counter()
        while not (landed := tier.completed(0)):
            if time.perf_counter() - t0 > COPY_TIMEOUT_S:
                raise RuntimeError(
                    f"install microbenchmark: a copy did not land in {COPY_TIMEOUT_S} s"
                )
            time.sleep(POLL_S)
        (handle,) = landed
        t0 = time.perf_counter()
        tier.install(0, handle, int(rng.choice(slots)))
        tier.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_read_drags(tier, k: int, rounds: int = 5, seed: int = 0) -> dict[str, float]:
    """Both drags of a tier, keyed as the profile's fields (0 off the disk tier)."""
    return {
        "host_read_drag": measure_host_read_drag(tier, k, rounds, seed=seed),
        "background_read_drag": measure_background_read_drag(tier, k, rounds, seed=seed),
    }


def microbenchmarks(tier, k: int, drag_rounds: int = 5, seed: int = 0) -> dict[str, float]:
    """The fast tier's expert time, both drags and its install, keyed as
    `moesub.calibration.unit_costs_from_fit` takes them (the install last: it overwrites
    slots)."""
    return {
        "expert_compute_s": measure_expert_compute(tier, k, seed=seed),
        **measure_read_drags(tier, k, drag_rounds, seed),
        "install_s": measure_install(tier, seed=seed),
    }


def round_order(names: list[str], rounds: int) -> list[str]:
    """Every name once per round, each round the one before rotated by about len / rounds: over
    the rounds a name runs near a round's start, middle and end alike (drift in the machine's
    speed favours none), and never twice in a row (a slow stretch of the disk, which lasts
    minutes on a VM, takes one of its runs, not two: the median over rounds outvotes it)."""
    n = len(names)
    stride = 0 if n <= 2 else min(-(-n // max(rounds, 1)), n - 2)
    order = []
    for r in range(rounds):
        shift = (r * stride) % n if n else 0
        order += names[shift:] + names[:shift]
    return order


def spread(runs: list[T], among: list[T]) -> list[T]:
    """`among` with `runs` spread evenly through it (after every len(among) / len(runs) of its
    names): a round's calibration runs then sit near every stretch of its policy runs."""
    out, placed = [], 0
    for i, name in enumerate(among):
        out.append(name)
        while placed < len(runs) and (placed + 1) * len(among) <= (i + 1) * len(runs):
            out.append(runs[placed])
            placed += 1
    return out + runs[placed:]


class Calibration:
    """The calibration's runs, one at a time (`run(name)`: a mechanism of `MECHANISMS` over the
    calibration streams on an engine of its own, then the microbenchmarks on its tier), and the
    profile fitted to them (`result`). `calibrate` runs them in rounds; the pipeline's engine
    stage spreads them among the policies' runs (`moesub.engine.stage.run_engine_stage`).
    Every input is checked on construction, before a run."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        device: str,
        tokens_path: str | os.PathLike,
        ranking_path: str | os.PathLike,
        size: float | Mapping[str, Any],
        params: Mapping[str, Any] | None = None,
    ) -> None:
        from moesub.artefacts import check_token_table, iter_streams

        self.model_dir, self.device = model_dir, device
        self.opts = opts = EngineParams.from_dict(params)
        require_file(tokens_path, "tokens_path")
        self.specs = {
            name: resolve_engine(
                model_dir,
                ALL_RESIDENT if policy is None else name,
                policy,
                size,
                device,
                params,
                ranking_path=None if policy is None else ranking_path,
            )  # fmt: skip
            for name, policy in MECHANISMS.items()
        }
        self.info = self.specs["cal_fetch"].info
        table = check_token_table(pl.read_parquet(tokens_path), self.info.vocab_size)
        # every calibration stream; each run decodes the next `calibrate_streams` of them in turn
        self.streams = [
            rows["token_id"].to_numpy()[: opts.calibrate_tokens]
            for _stream, rows in iter_streams(table)
        ]
        self.done = dict.fromkeys(MECHANISMS, 0)  # runs of each mechanism so far
        self.micro_every = max(1, -(-opts.calibrate_rounds // MICRO_RUNS))
        self.timed: dict[str, list[TimedTokens]] = {name: [] for name in MECHANISMS}
        self.disk: dict[str, list[DiskClock]] = {name: [] for name in MECHANISMS}  # each run's
        # every run's (wall_s, counts): the host's and admissions' terms are found through
        # their pricing, and every mechanism's error under the fitted profile (`run_errors`)
        self.counted: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {
            name: [] for name in MECHANISMS
        }
        # the microbenchmarks after runs of a C-slot tier spread over the rounds: the small
        # models' drags swing between jobs and within one (on the embedded model 2.1-3.4 between
        # calibrations, 2.2-3.2 between two processes minutes apart), so their medians are
        # taken beside every stretch of the runs
        self.micro: list[dict[str, float]] = []
        self.expert_bytes, self.tier, self.host_reads_link = None, "", False
        self.meter = CpuMeter()

    def order(self) -> list[str]:
        """Every mechanism once per round, `calibrate_rounds` rounds (`round_order`)."""
        return round_order(list(MECHANISMS), self.opts.calibrate_rounds)

    def run_streams(self, i: int) -> list[np.ndarray]:
        """The streams a mechanism's run `i` decodes: the next `calibrate_streams` of the
        calibration streams in turn, so that over many short rounds the runs cover them all."""
        n = min(self.opts.calibrate_streams, len(self.streams))
        return [self.streams[(i * n + j) % len(self.streams)] for j in range(n)]

    def run(self, name: str, loaded: LoadedModel | None = None) -> None:
        """The next run of mechanism `name` (`run_streams`), on an engine of its own (on
        `loaded`, the model loaded once for many engines, if given), then on a C-slot tier the
        microbenchmarks if the run is one of the `MICRO_RUNS` spread over the rounds."""
        k, i = self.info.top_k, self.done[name]
        self.done[name] += 1
        with EngineModel(self.model_dir, self.specs[name], loaded) as eng:
            self.meter.start()
            for ids in self.run_streams(i):
                disk0 = disk_clock(eng.setup.tier)
                r = eng.decode(ids)
                self.disk[name].append(disk_clock(eng.setup.tier) - disk0)
                self.timed[name].append(
                    TimedTokens.from_counts(r["wall_s"], r["layer_counts"], self.disk[name][-1])
                )
                self.counted[name].append((r["wall_s"], r["layer_counts"]))
            self.meter.pause()
            # a C-slot tier, loaded, with nothing in flight
            if MECHANISMS[name] is not None and i % self.micro_every == 0:
                eng.engine.reset(load=False)
                self.micro.append(microbenchmarks(eng.setup.tier, k, DRAG_ROUNDS))
                self.expert_bytes, self.tier = eng.setup.expert_bytes, eng.setup.tier.description
                self.host_reads_link = eng.setup.tier.host_reads_link

    def result(self) -> dict[str, Any]:
        """The profile fitted to every run so far (module doc), with what it was made from."""
        if not self.micro or not all(self.timed.values()):
            raise ValueError("calibration: every mechanism must have run at least once")
        timed, disk, info = self.timed, self.disk, self.info
        median = {key: float(np.median([m[key] for m in self.micro])) for key in self.micro[0]}
        fit = fit_unit_costs(TimedTokens.concat([t for runs in timed.values() for t in runs]))
        reference = reference_clock(disk[COPY_RUN])
        priced = self.host_reads_link  # the host's terms, the lane's start through the pricing
        seconds = unit_costs_from_fit(
            fit, k=info.top_k, layers=info.num_layers, expert_s=median["expert_compute_s"],
            host_runs=self.counted[HOST_RUN] if priced else None, reference=reference,
            host_clocks=disk[HOST_RUN], host_read_drag=median["host_read_drag"],
            background_read_drag=median["background_read_drag"], install_s=median["install_s"],
            admission_runs=self.counted[ADMIT_RUN] if priced else None,
            admission_clocks=disk[ADMIT_RUN],
        )  # fmt: skip
        profile = measured_profile(
            seconds,
            self.expert_bytes,
            f"the engine's calibration on {self.device} ({self.tier}), {self.model_dir}",
            self.host_reads_link,
        )
        return {
            "profile": profile.to_dict(),
            "expert_bytes": float(self.expert_bytes),
            "unit_costs": seconds,
            "at_run_disk": None if reference is None else AtRunDisk(reference).to_dict(),
            "disk_by_mechanism": {  # each mechanism's runs' reads, pooled
                name: asdict(DiskClock.pooled(clocks)) for name, clocks in disk.items()
            },
            "expert_compute_s": median["expert_compute_s"],
            "microbenchmarks": {"median": median, "runs": self.micro},
            "fit": fit.to_dict(),
            # each mechanism's runs priced at the profile (its copies at the reference speed)
            "run_errors": run_errors(
                self.counted, profile.price(ModelBytes(self.expert_bytes)), MECHANISM_DELAYS
            ),
            "runs": {name: int(sum(len(t.wall_s) for t in runs)) for name, runs in timed.items()},
            "rounds": self.opts.calibrate_rounds,
            "device": self.device,
            "tier": self.tier,
            "size": self.specs["cal_fetch"].size.to_dict(),
            "threads": torch.get_num_threads(),
            **self.meter.stop(),
        }


def calibrate(
    model_dir: str | os.PathLike,
    device: str,
    tokens_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    size: float | Mapping[str, Any],
    out_json: str | os.PathLike,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fit this machine's profile to timed engine runs of the model at `model_dir` on `device`
    (module doc): `engine.calibrate_rounds` rounds of every mechanism, each run over the next
    `engine.calibrate_streams` streams of the calibration token table `tokens_path` in turn
    (their first `engine.calibrate_tokens` tokens each), at cache size `size` (a resolved size
    or a fraction), each layer's initial experts from the expert ranking at `ranking_path`
    (`Calibration`).
    Writes the JSON to `out_json` (atomically) and returns it. Every input is checked before a
    run."""
    cal = Calibration(model_dir, device, tokens_path, ranking_path, size, params)
    loaded = load_engine_model(model_dir, device, cal.opts)  # once, for every run's engine
    try:
        for name in cal.order():
            cal.run(name, loaded)
    finally:
        loaded.close()
    out = cal.result()
    write_json(out, Path(out_json))
    return out
