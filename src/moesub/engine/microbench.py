"""The fast tier's microbenchmarks, which the calibration's fit cannot separate from its runs:
the fast tier's expert time (`measure_expert_compute`, on loaded slots), its slowdowns while the
link reads (`measure_host_read_drag`, `measure_background_read_drag`: the disk tier) and its
install of a landed copy (`measure_install`); `microbenchmarks` takes all four on one tier
(`moesub.engine.calibrate` after its runs, `moesub.engine.bench` once a round)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from moesub.engine.copies import COPY_TIMEOUT_S, POLL_S
from moesub.engine.kernels import expert_forward
from moesub.engine.tiers import DiskTier


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
