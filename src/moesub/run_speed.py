"""A run's speed: the disk's and the machine's while it ran, which the calibration and the runs it
prices are each measured at.

A shared disk's read time per expert drifts by up to half between runs a minute apart, and the
same calibration run, timed minutes apart, takes up to a fifth longer on a shared VM
(docs/measurements.md). The calibration (`moesub.calibration`) takes each of its runs' reads at
that run's speed (`DiskClock`, `copy_at_disk`) and the disk's speed from its median run
(`reference_clock`); a run is priced at the disk's speed while it read (`AtRunDisk`) and at the
machine's speed while it computed (`speed_probe`, `priced_at_speed`). What is left is the
pricing's own error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moesub.hardware import UnitCosts
from moesub.pricing import price_stream, price_streams
from moesub.vocabulary import TOKEN_LAYER_FIELDS

_F = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}


# ------------------------------------------------------------------ the disk's speed per run
# A shared disk's read time per expert drifts by up to half between runs a minute apart
# (docs/measurements.md). The calibration takes each of its runs' reads at that run's speed and
# the disk's speed from its median run; a run priced at that speed still carries the drift
# between it and the calibration. Priced at the disk's speed while it ran, what is left is the
# pricing's own error.


@dataclass(frozen=True)
class DiskClock:
    """What a run read from the disk tier's file (`ExpertStore.read_clock` differences)."""

    reads: int  # experts read
    busy_s: float  # seconds at least one read was in flight

    @property
    def per_read_s(self) -> float:
        return self.busy_s / self.reads if self.reads else float("nan")

    def __sub__(self, earlier: DiskClock) -> DiskClock:
        return DiskClock(self.reads - earlier.reads, self.busy_s - earlier.busy_s)

    @staticmethod
    def pooled(clocks: Sequence[DiskClock]) -> DiskClock:
        return DiskClock(sum(c.reads for c in clocks), sum(c.busy_s for c in clocks))


def copy_at_disk(copy_s: float, reference: DiskClock, run: DiskClock) -> float:
    """The copy term at a run's disk speed: `copy_s` (fitted on runs that read at `reference`'s
    speed) moved by the run's time per read less the reference's; the copy's other work stays.
    Unchanged when either read nothing."""
    if not (reference.reads and run.reads):
        return copy_s
    return max(copy_s + run.per_read_s - reference.per_read_s, 0.0)


def reference_clock(clocks: Sequence[DiskClock]) -> DiskClock | None:
    """The calibration's disk speed: of its copy runs (`moesub.engine.calibrate.COPY_RUN`: its
    reads are the synchronous copies the copy term prices) that read, the one at the median time
    per read (the lower of two), so that a slow stretch of the disk, which takes a run or two,
    does not set it; None where none read."""
    read = sorted((c for c in clocks if c.reads), key=lambda c: c.per_read_s)
    return read[(len(read) - 1) // 2] if read else None


@dataclass(frozen=True)
class AtRunDisk:
    """What pricing a run at the disk's speed while it read needs: the calibration's reference
    run (`reference_clock`), whose read time the copy term carries."""

    reference: DiskClock

    def costs(self, costs: UnitCosts, run: DiskClock) -> UnitCosts:
        """`costs` at the disk's speed while `run` read, its copies and the host's reads alike
        (a run that read nothing keeps them)."""
        copy_s = copy_at_disk(costs.copy_s, self.reference, run)
        return replace(costs, copy_s=copy_s, host_read_s=copy_s if run.reads else costs.host_read_s)

    def to_dict(self) -> dict[str, float]:
        return {"reads": self.reference.reads, "busy_s": self.reference.busy_s}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> AtRunDisk:
        return AtRunDisk(DiskClock(int(d["reads"]), float(d["busy_s"])))


# ------------------------------------------------------------------ the machine's speed per run
# The same calibration run, timed minutes apart, takes up to a fifth longer on a shared VM
# (docs/measurements.md). A run's own tokens that only hit are priced by compute terms alone:
# timed against that price, they say how fast the machine computed while the run ran.

# a run's speed probe needs at least this many tokens that only hit
SPEED_PROBE_TOKENS = 10
# what a token that only hits has none of: copies, host experts, forced misses, requests
_NOT_HIT = [_F[f] for f in ("fetch", "host", "forced", "prefetched", "admission_requests",
                            "admissions")]  # fmt: skip
# the terms the machine's speed moves: its compute (the disk has its own clock, `AtRunDisk`)
COMPUTE_TERMS = ("expert_s", "dense_layer_s", "token_overhead_s", "host_expert_s", "install_s",
                 "sync_step_s", "host_step_s", "background_start_s")  # fmt: skip


def speed_probe(wall_s: np.ndarray, counts: np.ndarray, token_s: np.ndarray) -> float:
    """How fast the machine computed during a run against the costs that priced it (`token_s`
    (T,), the price of each of its tokens; `wall_s` (T,) their measured times; `counts` (T, L,
    F)): over the tokens that only hit (every layer's experts in the slots, substitutes
    included; nothing copied, requested or computed by the host), their total time over their
    total price (1: as the calibration; 1.2: a fifth slower). Totals, as the errors it serves
    compare means: with medians, the slow tail of a small model's tokens (a stream's first
    ones) read as a machine 5-26% faster than it was (docs/measurements.md). NaN with fewer
    than `SPEED_PROBE_TOKENS` of them."""
    probe = counts[..., _NOT_HIT].sum(axis=(1, 2)) == 0  # (T,)
    if probe.sum() < SPEED_PROBE_TOKENS:
        return math.nan
    return float(wall_s[probe].sum() / token_s[probe].sum())


def costs_at_speed(costs: UnitCosts, speed: float) -> UnitCosts:
    """`costs` with the compute terms (`COMPUTE_TERMS`) scaled by `speed`; the copies kept (NaN
    speed: `costs` as they are)."""
    if math.isnan(speed):
        return costs
    return replace(costs, **{t: getattr(costs, t) * speed for t in COMPUTE_TERMS})


def priced_at_speed(
    wall_s: np.ndarray,
    streams: Sequence[np.ndarray],
    delay: int,
    costs: UnitCosts | Sequence[UnitCosts],
    priced: np.ndarray | None = None,
) -> tuple[np.ndarray, float, np.ndarray]:
    """A run's streams (their counts (T_i, L, F), `wall_s` (T,) their tokens' times in the same
    order) priced at `costs` (one for all, or one per stream: each at its own disk), each from
    an idle link (`priced`, where the caller has that price already), and again with the
    compute terms at the run's own speed (`speed_probe` over all its tokens, `costs_at_speed`):
    (price per token (T,), the speed, price per token at that speed (T,); NaN speed: the first
    price again)."""
    if priced is None:
        priced = _priced(streams, delay, costs)
    speed = speed_probe(wall_s, np.concatenate(streams), priced)
    if math.isnan(speed):
        return priced, speed, priced
    at_speed = (costs_at_speed(costs, speed) if isinstance(costs, UnitCosts)
                else [costs_at_speed(c, speed) for c in costs])  # fmt: skip
    return priced, speed, _priced(streams, delay, at_speed)


def _priced(
    streams: Sequence[np.ndarray], delay: int, costs: UnitCosts | Sequence[UnitCosts]
) -> np.ndarray:
    """Each stream priced from an idle link, at `costs` or at its own, their tokens in turn."""
    if isinstance(costs, UnitCosts):
        return price_streams(streams, delay, costs).token_s
    return np.concatenate([price_stream(c, delay, u).token_s
                           for c, u in zip(streams, costs, strict=True)])  # fmt: skip


# ----------------------------------------------------------------- a run's parts, for its error
# the columns that carry a run's parts' times and prices as measured, each in all (lists): a
# bench policy's rounds, an engine run's streams
ROUND_SUMS = ("round_time_s", "round_priced_s")
STREAM_SUMS = ("stream_time_s", "stream_priced_s")
# a run's error with each round left out in turn, the calibration refitted without it: its
# other rounds priced so (the rounds and the calibration together), and all of its rounds (the
# calibration alone); lists, one per round (a bench policy's rounds, an engine run's streams
# grouped by the engine stage's round each was decoded in)
JACKKNIFE_ERRORS = ("jackknife_rel_error", "calibration_jackknife_rel_error")
JACKKNIFE_MIN_ROUNDS = 3


def part_sums(x: np.ndarray, lengths: Sequence[int]) -> np.ndarray:
    """The sums (P,) of `x`'s consecutive parts of `lengths` tokens: a bench run's rounds, an
    engine run's streams, each a stretch of the machine, over which the analysis resamples a
    run's time against its price (`moesub.stats.pricing_error.error_interval`)."""
    x = np.asarray(x)
    if sum(lengths) != len(x):
        raise ValueError(f"parts of {sum(lengths)} tokens in all for {len(x)} tokens")
    return np.array([part.sum() for part in np.split(x, np.cumsum(lengths)[:-1])])


def left_out_errors(
    time_s: np.ndarray, priced_s: Sequence[np.ndarray]
) -> tuple[list[float], list[float]]:
    """A run's `JACKKNIFE_ERRORS` from its rounds' times in all, `time_s` (R,), and `priced_s[r]`
    (R,): every round's price at the calibration refitted without round r."""
    time_s = np.asarray(time_s, float)
    if len(priced_s) != len(time_s):
        raise ValueError(f"jackknife: {len(priced_s)} refits for {len(time_s)} rounds")
    joint, calibration = [], []
    for r, priced in enumerate(priced_s):
        priced = np.asarray(priced, float)
        calibration.append(float(priced.sum() / time_s.sum() - 1.0))
        joint.append(float((priced.sum() - priced[r]) / (time_s.sum() - time_s[r]) - 1.0))
    return joint, calibration


def engine_jackknife(
    wall_s: np.ndarray,
    streams: Sequence[np.ndarray],
    delay: int,
    refits: Sequence[UnitCosts],
    stream_rounds: Sequence[int] | None,
) -> tuple[list[float], list[float]]:
    """An engine run's `JACKKNIFE_ERRORS`: its streams (counts (T_i, L, F), `wall_s` (T,) their
    tokens' times in the same order) grouped by the engine stage's round each was decoded in
    (`stream_rounds`), each round left out in turn with the calibration refitted without that
    round's runs (`refits[r]`). Empty without refits, under `JACKKNIFE_MIN_ROUNDS` rounds, or
    where the rounds are not the refits' (a run decoded outside the stage)."""
    R = len(refits)
    if R < JACKKNIFE_MIN_ROUNDS or stream_rounds is None or len(stream_rounds) != len(streams):
        return [], []
    rounds = np.asarray(stream_rounds, np.int64)
    if rounds.min(initial=0) < 0 or rounds.max(initial=0) >= R:
        return [], []
    lengths = [len(s) for s in streams]

    def by_round(token_s: np.ndarray) -> np.ndarray:  # (T,) -> (R,)
        return np.bincount(rounds, weights=part_sums(token_s, lengths), minlength=R)

    priced = [by_round(price_streams(streams, delay, costs).token_s) for costs in refits]
    return left_out_errors(by_round(wall_s), priced)
