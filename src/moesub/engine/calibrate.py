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

import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import polars as pl
import torch

from moesub.calibration import TimedTokens, fit_unit_costs, run_errors, unit_costs_from_fit
from moesub.engine.adapter import LoadedModel, load_engine_model
from moesub.engine.contention import CpuMeter
from moesub.engine.generate import EngineModel
from moesub.engine.microbench import microbenchmarks
from moesub.engine.spec import EngineParams, resolve_engine
from moesub.engine.tiers import disk_clock
from moesub.hardware import HardwareProfile, ModelBytes, measured_profile
from moesub.io import require_file, write_json
from moesub.policy import ALL_RESIDENT, Policy
from moesub.run_speed import JACKKNIFE_MIN_ROUNDS, AtRunDisk, DiskClock, reference_clock

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
        self.micro_rounds: list[int] = []  # the round each was taken in
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
                self.micro_rounds.append(i)
                self.expert_bytes, self.tier = eng.setup.expert_bytes, eng.setup.tier.description
                self.host_reads_link = eng.setup.tier.host_reads_link

    def _fit(self, leave_out: int | None = None) -> tuple[dict, Any, dict, Any, HardwareProfile]:
        """(seconds, the fit, the microbenchmarks' medians, the disk's reference run, the
        profile) fitted to every run, or to every run but those of round `leave_out` (a run's
        index over `calibrate_streams` is its round; a microbenchmark's round is recorded)."""
        n = min(self.opts.calibrate_streams, len(self.streams))

        def kept(runs: list[T]) -> list[T]:
            return [run for i, run in enumerate(runs) if i // n != leave_out]

        timed, disk, counted = ({name: kept(runs) for name, runs in d.items()}
                                for d in (self.timed, self.disk, self.counted))  # fmt: skip
        micro = [m for m, r in zip(self.micro, self.micro_rounds, strict=True) if r != leave_out]
        median = {key: float(np.median([m[key] for m in micro])) for key in micro[0]}
        fit = fit_unit_costs(TimedTokens.concat([t for runs in timed.values() for t in runs]))
        reference = reference_clock(disk[COPY_RUN])
        priced = self.host_reads_link  # the host's terms, the lane's start through the pricing
        seconds = unit_costs_from_fit(
            fit, k=self.info.top_k, layers=self.info.num_layers,
            expert_s=median["expert_compute_s"],
            host_runs=counted[HOST_RUN] if priced else None, reference=reference,
            host_clocks=disk[HOST_RUN], host_read_drag=median["host_read_drag"],
            background_read_drag=median["background_read_drag"], install_s=median["install_s"],
            admission_runs=counted[ADMIT_RUN] if priced else None,
            admission_clocks=disk[ADMIT_RUN],
        )  # fmt: skip
        profile = measured_profile(
            seconds,
            self.expert_bytes,
            f"the engine's calibration on {self.device} ({self.tier}), {self.model_dir}",
            self.host_reads_link,
        )
        return seconds, fit, median, reference, profile

    def result(self) -> dict[str, Any]:
        """The profile fitted to every run so far (module doc), with what it was made from, and
        refitted with each round left out in turn (`jackknife_profiles`: the analysis's
        jackknife of the engine runs' errors, `moesub.run_speed.engine_jackknife`; none under
        `JACKKNIFE_MIN_ROUNDS` rounds)."""
        if not self.micro or not all(self.timed.values()):
            raise ValueError("calibration: every mechanism must have run at least once")
        seconds, fit, median, reference, profile = self._fit()
        rounds = min(self.done.values())
        # (the microbenchmarks follow runs in every `micro_every`-th round, 2 rounds or more
        # of them from 2 rounds on: leaving one out leaves some)
        jackknife = (
            [self._fit(r)[-1].to_dict() for r in range(rounds)]
            if rounds >= JACKKNIFE_MIN_ROUNDS
            else []
        )
        return {
            "profile": profile.to_dict(),
            "expert_bytes": float(self.expert_bytes),
            "unit_costs": seconds,
            "at_run_disk": None if reference is None else AtRunDisk(reference).to_dict(),
            "disk_by_mechanism": {  # each mechanism's runs' reads, pooled
                name: asdict(DiskClock.pooled(clocks)) for name, clocks in self.disk.items()
            },
            "expert_compute_s": median["expert_compute_s"],
            "microbenchmarks": {"median": median, "runs": self.micro},
            "fit": fit.to_dict(),
            # each mechanism's runs priced at the profile (its copies at the reference speed)
            "run_errors": run_errors(
                self.counted, profile.price(ModelBytes(self.expert_bytes)), MECHANISM_DELAYS
            ),
            "jackknife_profiles": jackknife,
            "runs": {n: int(sum(len(t.wall_s) for t in runs)) for n, runs in self.timed.items()},
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
