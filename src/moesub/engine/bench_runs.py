"""One timed run of the engine over router logits, as the real-size benchmark makes it
(`moesub.engine.bench`), and what it counted.

`run_policy` drives an `OffloadEngine` token by token over logits (T, L, E): per layer a
real-size router matmul on the fast device whose result reaches the host (the synchronization
a real router imposes), the policy core's step on the given logits, the experts computed from
the slots (and the host's). `BenchRun` holds the per-token wall times and counters, per
token-layer too (`TOKEN_LAYER_FIELDS`); `by_status` names the status counts, `timed_tokens`
gives the cost fit's regressors (`moesub.calibration`), `fit_bench_costs` the profile fitted to
the calibration runs, `counts_frame` / `read_bench_counts` the per-token-layer table the
benchmark writes beside its own. A policy runs a share of its tokens per round (`round_part`);
`policy_row` is its row over them, priced as measured, at each run's disk and at its own speed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from moesub.calibration import TimedTokens, fit_unit_costs, run_errors, unit_costs_from_fit
from moesub.engine.calibrate import ADMIT_RUN, COPY_RUN, HOST_RUN, MECHANISM_DELAYS
from moesub.engine.contention import CpuMeter
from moesub.engine.runtime import HostInputs, OffloadEngine
from moesub.engine.tiers import disk_clock
from moesub.hardware import ModelBytes, UnitCosts, is_contended, measured_profile
from moesub.io import require_file, write_parquet
from moesub.policy import STATUS_NAMES, TOKEN_LAYER_DTYPE, TOKEN_LAYER_FIELDS, Policy
from moesub.pricing import price_stream, price_streams
from moesub.run_speed import (
    JACKKNIFE_ERRORS,
    JACKKNIFE_MIN_ROUNDS,
    ROUND_SUMS,
    AtRunDisk,
    DiskClock,
    left_out_errors,
    part_sums,
    priced_at_speed,
    reference_clock,
)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@dataclass
class BenchRun:
    """Per measured token (T,) of one run, and two totals."""

    wall_s: np.ndarray
    fetch_wait_s: np.ndarray
    bytes_sync: np.ndarray
    bytes_bg: np.ndarray
    counts: np.ndarray  # (T, S) slots per status code (`STATUS_NAMES` order), all layers
    layer_counts: np.ndarray  # (T, L, len(TOKEN_LAYER_FIELDS)) what the policy did per layer
    admissions: np.ndarray  # (T,) admission requests per token
    syncs: np.ndarray  # (T,) host waits for the device per token
    admitted: int  # background copies installed
    admit_latency: int  # tokens from request to install, summed over those installed
    cpu_share: float  # the run's CPU share (`moesub.engine.contention`)
    other_cores: float  # the cores other processes kept busy beside it (and a VM host's steal)
    disk: DiskClock = DiskClock(0, 0.0)  # what the measured tokens read from the disk tier


@torch.inference_mode()
def run_policy(
    engine: OffloadEngine,
    trace: np.ndarray,
    router_w: list[torch.Tensor],
    h0: torch.Tensor,
    warmup: int,
    desc: str,
    progress: bool,
    layers: int | None = None,
) -> BenchRun:
    """Drive a freshly built engine over `trace` (T, L, E) (its first `layers` layers, default
    all); the first `warmup` tokens are not recorded. The build left the caches at the initial
    set and loaded the slots: a reset here would read them all again."""
    T, L, _E = trace.shape
    L = layers or L
    n = T - warmup
    wall, wait = np.zeros(n), np.zeros(n)
    bsync, bbg = np.zeros(n, np.int64), np.zeros(n, np.int64)
    counts = np.zeros((n, len(STATUS_NAMES)), np.int64)
    layer_counts = np.zeros((n, L, len(TOKEN_LAYER_FIELDS)), TOKEN_LAYER_DTYPE)
    syncs, admissions = np.zeros(n, np.int64), np.zeros(n, np.int64)
    admitted = admit_latency = 0
    disk0 = disk_clock(engine.tier)
    meter = CpuMeter().start()
    for t in tqdm(range(T), desc=desc, unit="tok", disable=not progress, leave=False):
        if t == warmup:
            disk0 = disk_clock(engine.tier)
        t0 = time.perf_counter()
        engine.begin_token()
        hidden = h0  # (1, H) every token enters with the same hidden state
        for layer in range(L):
            x = rms_norm(hidden)
            # the router on the fast device; its logits (and the input, for host_compute)
            # reach the host once before the core decides, as in the model adapter
            _z, x_host = engine.to_host(layer, (x @ router_w[layer].T).float(), x)
            s = engine.route(layer, trace[t, layer][None])
            slot, host_ids = engine.step_ids(s)
            w = engine.tier.upload(layer, s.weights, "weights").to(hidden.dtype)
            host = None
            if host_ids is not None:
                host = HostInputs(host_ids, x_host, torch.from_numpy(s.weights).to(x_host.dtype))
            y = engine.compute(layer, x, slot, w, host)
            hidden = hidden + y
        st = engine.end_token()  # waits for the compute stream
        dt = time.perf_counter() - t0
        if t >= warmup:
            i = t - warmup
            wall[i], wait[i] = dt, st.fetch_wait_s
            bsync[i], bbg[i] = st.bytes_sync, st.bytes_bg
            counts[i], syncs[i], layer_counts[i] = st.counts, st.syncs, st.layer_counts[:L]
            admissions[i] = st.admissions
            admitted += st.admitted
            admit_latency += st.admit_latency
    use = meter.stop()
    disk = disk_clock(engine.tier) - disk0
    if not torch.isfinite(hidden.float()).all():
        raise RuntimeError("benchmark hidden state became non-finite")
    return BenchRun(
        wall, wait, bsync, bbg, counts, layer_counts, admissions, syncs, admitted, admit_latency,
        use["cpu_share"], use["other_cores"], disk,
    )  # fmt: skip


def concat_runs(runs: list[BenchRun]) -> BenchRun:
    return BenchRun(
        wall_s=np.concatenate([r.wall_s for r in runs]),
        fetch_wait_s=np.concatenate([r.fetch_wait_s for r in runs]),
        bytes_sync=np.concatenate([r.bytes_sync for r in runs]),
        bytes_bg=np.concatenate([r.bytes_bg for r in runs]),
        counts=np.concatenate([r.counts for r in runs]),
        layer_counts=np.concatenate([r.layer_counts for r in runs]),
        admissions=np.concatenate([r.admissions for r in runs]),
        syncs=np.concatenate([r.syncs for r in runs]),
        admitted=sum(r.admitted for r in runs),
        admit_latency=sum(r.admit_latency for r in runs),
        cpu_share=float(np.median([r.cpu_share for r in runs])),
        other_cores=float(np.median([r.other_cores for r in runs])),
        disk=DiskClock.pooled([r.disk for r in runs]),
    )


def hits_only(logits: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """`logits` (T, L, E) with every expert outside the layer's resident set `initial` (L, C)
    pushed down so far that it is never selected: a fetch_all run is then all hits."""
    out = logits.copy()
    for layer in range(out.shape[1]):
        mask = np.ones(out.shape[2], bool)
        mask[initial[layer]] = False
        out[:, layer, mask] -= 1e4
    return out


def by_status(counts: np.ndarray) -> dict[str, np.ndarray]:
    """Counts (..., S) in `STATUS_NAMES` order -> {status name: counts (...)}."""
    return dict(zip(STATUS_NAMES, np.moveaxis(counts, -1, 0), strict=True))


def timed_tokens(r: BenchRun) -> TimedTokens:
    return TimedTokens.from_counts(r.wall_s, r.layer_counts, r.disk)


def fit_bench_costs(
    runs: Mapping[str, list[BenchRun]],
    names: Sequence[str],
    micro: list[dict[str, float]],
    host_reads_link: bool,
    top_k: int,
    layers: int,
    expert_bytes: float,
    info: dict[str, Any] | None = None,
) -> tuple[dict[str, float], UnitCosts, DiskClock | None]:
    """This machine's profile fitted to the calibration runs `names` (those that ran) with the
    medians of their rounds' microbenchmarks `micro` (`moesub.calibration`, as the pipeline's
    calibration does): its seconds, its costs for the benchmark's experts, and the reference
    copy run on the disk (None: no reads). `info`, where given, gets what it was made from and
    each calibration run's error at those costs (`calibration_run_errors`: `run_errors`)."""
    names = [n for n in names if runs[n]]
    fit = fit_unit_costs(TimedTokens.concat([timed_tokens(r) for n in names for r in runs[n]]))
    host, admit = runs[HOST_RUN], runs[ADMIT_RUN]
    median = {key: float(np.median([m[key] for m in micro])) for key in micro[0]}
    reference = reference_clock([r.disk for r in runs[COPY_RUN]])
    seconds = unit_costs_from_fit(
        fit, k=top_k, layers=layers, expert_s=median["expert_compute_s"],
        host_runs=[(r.wall_s, r.layer_counts) for r in host] if host_reads_link else None,
        reference=reference, host_clocks=[r.disk for r in host],
        **{d: median[d] for d in ("host_read_drag", "background_read_drag", "install_s")},
        admission_runs=[(r.wall_s, r.layer_counts) for r in admit] if host_reads_link else None,
        admission_clocks=[r.disk for r in admit],
    )  # fmt: skip
    profile = measured_profile(
        seconds, expert_bytes, "the engine benchmark's calibration runs", host_reads_link
    )
    costs = profile.price(ModelBytes(expert_bytes))
    if info is None:  # a refit (`refit_without_each_round`): the costs alone
        return seconds, costs, reference
    counted = {n: [(r.wall_s, r.layer_counts) for r in runs[n]] for n in names}
    info["microbenchmarks"] = {"median": median, "runs": micro}  # one per round
    info["cost_fit"] = fit.to_dict()
    info["profile"] = profile.to_dict()
    info["at_run_disk"] = None if reference is None else AtRunDisk(reference).to_dict()
    info["calibration_run_errors"] = run_errors(counted, costs, MECHANISM_DELAYS)
    return seconds, costs, reference


def refit_without_each_round(
    runs: Mapping[str, list[BenchRun]],
    names: Sequence[str],
    micro: list[dict[str, float]],
    *fit: Any,
) -> list[UnitCosts]:
    """The calibration refitted with each round left out in turn: `fit_bench_costs` (`fit`: its
    arguments after `micro`) on the other rounds' runs and microbenchmarks, one profile's costs
    per round (a run's index in `runs[name]` is its round); none under `JACKKNIFE_MIN_ROUNDS`
    rounds."""
    if len(micro) < JACKKNIFE_MIN_ROUNDS:
        return []
    out = []
    for r in range(len(micro)):
        kept = {name: rs[:r] + rs[r + 1 :] for name, rs in runs.items()}
        out.append(fit_bench_costs(kept, names, micro[:r] + micro[r + 1 :], *fit)[1])
    return out


def jackknife_errors(
    runs: list[BenchRun], delay: int, refits: Sequence[UnitCosts]
) -> tuple[list[float], list[float]]:
    """A policy's `JACKKNIFE_ERRORS` (`moesub.run_speed.left_out_errors`): each round r left out
    in turn, the calibration refitted without it (`refits[r]`). Empty without refits."""
    if not refits:
        return [], []
    if len(refits) != len(runs):
        raise ValueError(f"jackknife: {len(refits)} refits for {len(runs)} rounds")
    wall = np.array([run.wall_s.sum() for run in runs])
    priced = [np.array([price_stream(run.layer_counts, delay, costs).token_s.sum()
                        for run in runs]) for costs in refits]  # fmt: skip
    return left_out_errors(wall, priced)


def counts_frame(name: str, round_: int, run: BenchRun) -> pl.DataFrame:
    """One run's per-token-layer counts as rows `policy, round, token, layer`, the
    `TOKEN_LAYER_FIELDS` counts (int16) and the token's wall time `wall_s` (each layer's row)."""
    T, L, _F = run.layer_counts.shape
    flat = run.layer_counts.reshape(T * L, -1)
    return pl.DataFrame(
        {
            "policy": np.full(T * L, name),
            "round": np.full(T * L, round_, np.int16),
            "token": np.repeat(np.arange(T, dtype=np.int32), L),
            "layer": np.tile(np.arange(L, dtype=np.int16), T),
            **{f: flat[:, i] for i, f in enumerate(TOKEN_LAYER_FIELDS)},
            "wall_s": np.repeat(run.wall_s, L),
        }
    )


def counts_path_for(out_path: str | os.PathLike) -> Path:
    """Where the benchmark's per-token-layer counts go by default: beside its table,
    `<stem>_token_layers.parquet`."""
    out = Path(out_path)
    return out.with_name(f"{out.stem}_token_layers.parquet")


def write_bench_counts(
    path: str | os.PathLike,
    runs: dict[str, list[BenchRun]],
    policies: dict[str, Policy],
    capacity: int,
) -> Path:
    """Every run's per-token-layer counts (`counts_frame` rows, one run per round), atomically;
    metadata: the fields, each run's policy as run (pins resolved) and the slots per layer."""
    frames = [counts_frame(name, i, r) for name, rs in runs.items() for i, r in enumerate(rs)]
    meta = {
        "fields": list(TOKEN_LAYER_FIELDS),
        "policies": {name: pol.to_dict() for name, pol in policies.items()},
        "capacity": capacity,
    }
    return write_parquet(pl.concat(frames), path, metadata=meta)


def read_bench_counts(path: str | os.PathLike) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """The benchmark's per-token-layer table (`counts_frame` rows): per run name, one
    `(wall_s (T,), counts (T, L, F) int16)` per round, in round order (each round's run starts
    from fresh caches, as a stream does)."""
    df = pl.read_parquet(require_file(path, "path"))
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for (name, _round), rows in df.sort("policy", "round", "token", "layer").group_by(
        "policy", "round", maintain_order=True
    ):
        T, L = rows["token"].n_unique(), rows["layer"].n_unique()
        counts = rows.select(TOKEN_LAYER_FIELDS).to_numpy().astype(TOKEN_LAYER_DTYPE)
        out.setdefault(name, []).append(
            (rows["wall_s"].to_numpy()[::L].copy(), counts.reshape(T, L, len(TOKEN_LAYER_FIELDS)))
        )
    return out


def at_run_disk(
    runs: dict[str, list[BenchRun]], reference: DiskClock | None, costs: UnitCosts
) -> dict[str, list[UnitCosts]]:
    """Per run name, one `costs` per round at the disk's speed while that run read, against the
    calibration's `reference` run (`moesub.run_speed.AtRunDisk`): the pricing's arithmetic
    apart from the disk's drift between runs. Without a reference (a tier that reads no file,
    the CUDA tier's) every run keeps `costs`."""
    at = None if reference is None else AtRunDisk(reference)
    return {
        name: [costs if at is None else at.costs(costs, r.disk) for r in rs]
        for name, rs in runs.items()
    }


def round_part(tokens: int, warmup: int, rounds: int, round_: int) -> slice:
    """The rows of a run's logits (`warmup` + `tokens` of them) that round `round_` runs: its
    share of the `tokens` measured ones (contiguous, the `rounds` shares as even as they go,
    the first ones longer), after the `warmup` rows before it, run unrecorded."""
    start = round_ * (tokens // rounds) + min(round_, tokens % rounds)
    stop = start + tokens // rounds + (round_ < tokens % rounds)
    return slice(start, warmup + stop)


# `disk_drifted`: a policy's read time per expert this far from the reference run's (a
# run's moves by 20-36% between runs minutes apart on this VM's disk, benches of 2026-12-03)
DISK_DRIFT_BEYOND = 0.15


def disk_drift(runs: list[BenchRun], reference: DiskClock | None) -> dict[str, float | bool]:
    """A policy's reads against the calibration's `reference` copy run: the time per read over
    all its runs (`disk_read_s`), that over the reference's (`disk_vs_calibration`), and whether
    it is beyond `DISK_DRIFT_BEYOND` (`disk_drifted`; NaN where nothing read: False). A policy
    whose host reads its experts is compared with copies: its worker's reads, beside the slots'
    compute, ran 1.3-1.6x a copy's time on 2026-12-06, so its ratio is not the drift alone."""
    read_s = DiskClock.pooled([r.disk for r in runs]).per_read_s
    drift = math.nan if reference is None else read_s / reference.per_read_s
    return {
        "disk_read_s": read_s,
        "disk_vs_calibration": drift,
        "disk_drifted": bool(abs(drift - 1) > DISK_DRIFT_BEYOND),
    }


def round_sums(runs: list[BenchRun], priced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A policy's rounds' times and prices in all, (R,) each: `priced` is its runs' tokens in
    turn. The statistics over rounds (`round_spread` here; the interval of the error, in the
    analysis) take a round, a stretch of the machine, as their unit."""
    lengths = [len(r.wall_s) for r in runs]
    return np.array([r.wall_s.sum() for r in runs]), part_sums(priced, lengths)


def round_spread(runs: list[BenchRun], priced: np.ndarray) -> float:
    """A policy's rounds against each other: each round's time over its price (`priced`, its
    runs' tokens in turn), (max - min) / median of those ratios
    (NaN with one round). The rounds run different tokens, so their times differ by their work;
    over their price, what is left is the machine's noise between rounds and what the pricing
    misses in each."""
    if len(runs) < 2:
        return float("nan")
    time_s, priced_s = round_sums(runs, priced)
    ratios = time_s / priced_s
    return float((ratios.max() - ratios.min()) / np.median(ratios))


def policy_row(
    runs: list[BenchRun],
    delay: int,
    costs: UnitCosts,
    run_disk: list[UnitCosts],
    reference: DiskClock | None,
    refits: Sequence[UnitCosts] = (),
) -> dict[str, Any]:
    """A policy's row over its runs (its rounds, each priced from an idle link, as each ran):
    its time per token, what it did, and the pricing's estimate on the same tokens beside, at
    `costs`, at each run's disk (`run_disk`, against the calibration's `reference` run; None: a
    tier reading no file, priced at `costs`) and then with its compute at its own speed, one
    for all its rounds (`moesub.run_speed.priced_at_speed`: as its calibration is fitted over
    all of its own, over many short rounds both see the same stretches of the machine), each
    against its measured mean. The last is the pricing's arithmetic apart from the machine's
    drift: a policy that only hits is priced from its own times, its error nil by
    construction; the others' errors are what their other tokens cost beyond their price.
    With `refits` (`refit_without_each_round`), its errors with each round left out
    (`jackknife_errors`)."""
    r = concat_runs(runs)
    slots = max(int(r.counts.sum()), 1)
    c = by_status(r.counts.sum(axis=0))
    streams = [run.layer_counts for run in runs]
    at_disk, speed, at_speed = priced_at_speed(r.wall_s, streams, delay, run_disk)
    est_disk, est_speed = float(at_disk.mean()), float(at_speed.mean())
    plain = at_disk if reference is None else price_streams(streams, delay, costs).token_s
    est = float(plain.mean())
    measured = float(r.wall_s.mean())
    return {
        "tokens": len(r.wall_s),
        "time_per_token_median_s": float(np.median(r.wall_s)),
        "time_per_token_p90_s": float(np.percentile(r.wall_s, 90)),
        "time_per_token_mean_s": measured,
        "round_spread": round_spread(runs, at_disk),
        "fetch_wait_s": float(r.fetch_wait_s.mean()),
        "bytes_sync": float(r.bytes_sync.mean()),
        "bytes_bg": float(r.bytes_bg.mean()),
        "hit_rate": float(c["hit"] / slots),
        "sub_rate": float(c["sub"] / slots),
        "syncs_per_token": float(r.syncs.mean()),
        "admit_latency_tokens": r.admit_latency / r.admitted if r.admitted else math.nan,
        "est_time_per_token_s": est,
        "sim_rel_error": (est - measured) / measured,
        # per round, its time and its price as measured in all: the error's interval over the
        # rounds is the analysis's (`moesub.stats.pricing_error.engine_bench`)
        **dict(zip(ROUND_SUMS, (sums.tolist() for sums in round_sums(runs, plain)), strict=True)),
        # each round left out, the calibration refitted without it (the analysis's jackknife)
        **dict(zip(JACKKNIFE_ERRORS, jackknife_errors(runs, delay, refits), strict=True)),
        "est_at_run_disk_s": est_disk,
        "sim_rel_error_at_run_disk": (est_disk - measured) / measured,
        "run_speed": speed,
        "est_at_run_speed_s": est_speed,
        "sim_rel_error_at_run_speed": (est_speed - measured) / measured,
        "cpu_share": r.cpu_share,
        "other_cores": r.other_cores,
        "contended": is_contended(r.cpu_share, r.other_cores),
        **disk_drift(runs, reference),
    }
