"""A machine's unit costs fitted to timed engine runs: where `this_machine`'s profile comes from.

The engine's calibration (`moesub.engine.calibrate`, the pipeline's model) and the real-size
benchmark (`moesub.engine.bench`) time the engine on runs made for the purpose, one mechanism
each (every expert a hit; every miss fetched; every miss computed by the host; background
admissions), in interleaved rounds, and record every token's wall time and per-token-layer
counts (`TOKEN_LAYER_FIELDS`). `fit_unit_costs` regresses the wall times on the pricing's terms
(docs/pricing.md, one processor: a token is the sum of its parts), by non-negative least
squares (`scipy.optimize.nnls`) with the tokens another process slowed (residuals beyond
`cut` robust standard deviations) left out, iteratively:

    wall = token_s + layers x layer_s + copies x copy_s + sync_steps x sync_step_s
           + host x host_extra_s + host_steps x host_step_s + installs x install_s

`layers` is the token's MoE layer steps, `copies` its synchronous copies (fetch, forced),
`sync_steps` its layer steps that copy synchronously (a step pays once for issuing its copies
and resuming after the wait: docs/pricing.md; where every such step copies one expert, as
with top-1 routing, the two cannot be told apart and `copy_s` carries it),
`host` its experts computed by the host, `host_steps` its layer steps with any (a step pays
once for handing them to the host and taking its results back; `host_extra_s` carries it where
every such step has as many), `installs` its background copies installed
(admissions landed, prefetched). Where the runs read a file (the disk tier) and timed their
reads (`DiskClock`), a shared disk's speed drifts by up to half between runs a minute apart:
each token's copies are then taken as read at its own run's speed (`read_s`, subtracted from
its wall time), `copy_s` is fitted as the copy's work beyond its read, and the disk's speed
enters once, as the calibration's copy run at the median time per read (`reference_clock`;
both in `moesub.run_speed`). Every layer computes k experts, each on the fast tier or the host,
so the fast tier's expert time is inside `layer_s` and the host's term is its excess over it
(`host_extra_s`).
`unit_costs_from_fit` splits the per-layer constant into the dense work and k fast experts with
a microbenchmarked expert time, and gives the pricing's seconds
(`moesub.hardware.measured_profile` makes them a profile). Where the tier's host reads its
experts over the link (the disk tier), the engine overlaps those reads with the fast path, and
the host's terms are instead its step and its compute alone, found through the pricing of the
host runs, each with its reads at its own disk speed (`host_terms_by_pricing`), and its reads
are priced at the host runs' speed (`host_read_s`); the fit's `host_extra_s` and `host_step_s`
then only keep the host runs' tokens from pulling the other terms. There the reads also slow
the fast tier's work (`host_read_drag`, `background_read_drag`: microbenchmarked). The install is
microbenchmarked too (the engine's own install of a copy just read); the fit's `install_s` then
only keeps the admission runs' tokens from pulling the other terms. And a batch of background
copies that finds the I/O thread idle costs the fast tier a start (`background_start_s`),
found through the pricing of the admission runs with every other term as found. A term no run
exercises, or terms the runs cannot tell apart, make the fit degenerate: a ValueError says
which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from scipy.optimize import nnls

from moesub.hardware import UnitCosts
from moesub.pricing import price_stream
from moesub.run_speed import DiskClock, copy_at_disk
from moesub.vocabulary import TOKEN_LAYER_FIELDS

FIT_TERMS = ("token_s", "layer_s", "copy_s", "sync_step_s", "host_extra_s", "host_step_s",
             "install_s")  # fmt: skip
# what each term's regressor counts, for the errors
_COUNTED = {
    "token_s": "token",
    "layer_s": "MoE layer step",
    "copy_s": "synchronous copy (fetch, forced)",
    "sync_step_s": "MoE layer step with synchronous copies",
    "host_extra_s": "expert computed by the host",
    "host_step_s": "MoE layer step with experts computed by the host",
    "install_s": "background copy installed (admission landed, prefetch)",
}
_F = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}


@dataclass(frozen=True)
class TimedTokens:
    """Timed tokens of engine runs: wall seconds and the fit's regressors, (n,) each."""

    wall_s: np.ndarray
    layers: np.ndarray  # MoE layer steps
    copies: np.ndarray  # synchronous copies (fetch + forced)
    sync_steps: np.ndarray  # MoE layer steps with synchronous copies
    host: np.ndarray  # experts computed by the host
    host_steps: np.ndarray  # MoE layer steps with experts computed by the host
    installs: np.ndarray  # background copies installed (admissions landed + prefetched)
    read_s: np.ndarray  # seconds its copies read at its run's disk speed (0: not timed)

    @classmethod
    def from_counts(
        cls, wall_s: np.ndarray, counts: np.ndarray, disk: DiskClock | None = None
    ) -> TimedTokens:
        """From per-token wall times (n,) and per-token-layer counts (n, L, F), and what their
        run read (`disk`: its copies read at that speed; none or no reads: not timed)."""
        c = np.asarray(counts, np.int64)
        if c.ndim != 3 or c.shape[2] != len(TOKEN_LAYER_FIELDS) or len(c) != len(wall_s):
            raise ValueError(
                f"timed tokens: wall_s {np.shape(wall_s)} and counts {c.shape} do not match "
                f"(n,) and (n, L, {len(TOKEN_LAYER_FIELDS)})"
            )
        per = c.sum(axis=1)  # (n, F)
        sync = c[:, :, _F["fetch"]] + c[:, :, _F["forced"]]  # (n, L) synchronous copies
        copies = sync.sum(axis=1).astype(float)
        return cls(
            wall_s=np.asarray(wall_s, float),
            layers=np.full(len(c), c.shape[1], float),
            copies=copies,
            sync_steps=(sync > 0).sum(axis=1).astype(float),
            host=per[:, _F["host"]].astype(float),
            host_steps=(c[:, :, _F["host"]] > 0).sum(axis=1).astype(float),
            installs=(per[:, _F["admissions"]] + per[:, _F["prefetched"]]).astype(float),
            read_s=copies * (disk.per_read_s if disk is not None and disk.reads else 0.0),
        )

    @classmethod
    def concat(cls, parts: Sequence[TimedTokens]) -> TimedTokens:
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def design(self) -> np.ndarray:
        """(n, len(FIT_TERMS)) regressors in `FIT_TERMS` order."""
        n = len(self.wall_s)
        return np.stack([np.ones(n), self.layers, self.copies, self.sync_steps, self.host,
                         self.host_steps, self.installs], 1)  # fmt: skip


@dataclass(frozen=True)
class CostFit:
    """What `fit_unit_costs` found."""

    coef: dict[str, float]  # FIT_TERMS -> seconds (layer_s 0 when every run had the same L,
    # sync_step_s 0 when every step that copied copied as many experts, host_step_s when every
    # step with host experts had as many)
    layers_identified: bool  # runs with different layer counts separated token_s and layer_s
    tokens: int  # timed tokens
    kept: int  # tokens in the final fit
    at_zero: list[str]  # fitted terms the non-negativity bound holds at 0
    residual_mad_s: float  # robust spread of the kept tokens' residuals

    def to_dict(self) -> dict[str, Any]:
        return {**self.coef, "layers_identified": self.layers_identified, "tokens": self.tokens,
                "kept": self.kept, "at_zero": self.at_zero,
                "residual_mad_s": self.residual_mad_s}  # fmt: skip


def fit_unit_costs(tokens: TimedTokens, cut: float = 6.0, rounds: int = 8) -> CostFit:
    """Non-negative least squares of per-token wall time, less its timed reads, on `FIT_TERMS`
    (module doc), tokens beyond `cut` robust standard deviations of the residuals left out,
    refitted up to `rounds` times; a step's wait is left to the copy where no run tells them
    apart (every step that copied copied as many experts: one, with top-1 routing), and a host
    step's cost to the host's expert alike. ValueError when a term is never exercised or the
    terms are not separable."""
    X, wall = tokens.design(), np.asarray(tokens.wall_s, float)
    if not np.isfinite(wall).all() or (wall < 0).any():
        raise ValueError("cost fit: wall times must be finite and >= 0")
    y = wall - tokens.read_s  # a token on a fast stretch of the disk may come out below 0
    layers_identified = bool(np.ptp(X[:, 1]) > 0) if len(y) else False
    left_out = set() if layers_identified else {"layer_s"}
    for each, step in (("copy_s", "sync_step_s"), ("host_extra_s", "host_step_s")):
        i, j = FIT_TERMS.index(each), FIT_TERMS.index(step)
        if X[:, i].any() and np.linalg.matrix_rank(X[:, [i, j]]) < 2:  # `each` carries it
            left_out.add(step)
    used = [i for i, t in enumerate(FIT_TERMS) if t not in left_out]
    if len(y) < 2 * len(used):
        raise ValueError(f"cost fit: {len(y)} timed tokens, need at least {2 * len(used)}")
    for i in used:
        if not X[:, i].any():
            raise ValueError(
                f"cost fit: no timed token has any {_COUNTED[FIT_TERMS[i]]}, so {FIT_TERMS[i]} "
                "cannot be fitted (a calibration run of that mechanism is missing or empty)"
            )
    A = X[:, used]
    if np.linalg.matrix_rank(A) < len(used):
        raise ValueError(
            f"cost fit: the terms {[FIT_TERMS[i] for i in used]} cannot be told apart on these "
            "runs (their counts are proportional); add runs that vary them independently"
        )
    keep = np.ones(len(y), bool)
    beta = np.zeros(len(used))
    for _ in range(rounds):
        beta = nnls(A[keep], y[keep])[0]
        r = y - A @ beta
        centre = np.median(r[keep])
        mad = 1.4826 * float(np.median(np.abs(r[keep] - centre)))
        new = np.abs(r - centre) <= cut * max(mad, 1e-12)
        if (new == keep).all() or new.sum() < 2 * len(used):
            break
        keep = new
    coef = dict.fromkeys(FIT_TERMS, 0.0)
    coef.update({FIT_TERMS[i]: float(b) for i, b in zip(used, beta, strict=True)})
    return CostFit(
        coef=coef,
        layers_identified=layers_identified,
        tokens=len(y),
        kept=int(keep.sum()),
        at_zero=[FIT_TERMS[i] for i, b in zip(used, beta, strict=True) if b == 0.0],
        residual_mad_s=mad,
    )


def unit_costs_from_fit(
    fit: CostFit,
    *,
    k: int,
    layers: int,
    expert_s: float,
    host_runs: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    reference: DiskClock | None = None,
    host_clocks: Sequence[DiskClock] = (),
    host_read_drag: float = 0.0,
    background_read_drag: float = 0.0,
    install_s: float | None = None,
    admission_runs: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    admission_clocks: Sequence[DiskClock] = (),
) -> dict[str, float]:
    """The pricing's seconds for runs of `layers` MoE layers, top-`k`: the per-layer constant
    (`layer_s`, or `token_s / layers` when the runs could not separate them: the token's
    fixed part is then spread over its layers) is k fast experts (`expert_s`, microbenchmarked;
    lowered to the constant / k if it would leave the dense work negative) plus the dense work;
    a host expert is a fast one plus the fitted excess. Where the fit's tokens had their reads
    timed (`read_s`), a copy is the fitted work beyond the read plus a read at `reference`'s
    speed. Where the tier's host reads its experts over the link (`host_runs` given: the host
    runs' `(wall_s (T,), counts (T, L, F))`), its work slows by the microbenchmarked
    `host_read_drag` and `background_read_drag` while the link reads the host's experts and
    background copies (kept in the seconds, as fractions), and the host's step and compute
    alone are found through the pricing of the host runs (`host_terms_by_pricing`), each run's
    reads at its own speed (`host_clocks`: one per run) where they were timed, and a host's
    read is then the copy at the host runs' pooled speed (`host_read_s`; else a copy). The
    install is `install_s`, timed apart (`moesub.engine.microbench.measure_install`), where
    given; else the linear fit's (which carries the drag of the reads its admissions
    overlapped, where the link reads beside the fast path). Where the admission runs are given
    too (`admission_runs`, their `admission_clocks` one per run; with `host_runs`), the start
    of the idle background lane (`background_start_s`) is found through their pricing, with
    every other term as found (`term_by_pricing`); else it is 0."""
    if fit.layers_identified:
        token, per_layer = fit.coef["token_s"], fit.coef["layer_s"]
    else:
        token, per_layer = 0.0, fit.coef["token_s"] / layers
    expert = min(max(expert_s, 0.0), per_layer / k)
    beyond_read = fit.coef["copy_s"]
    seconds = {
        "token_overhead_s": token,
        "dense_layer_s": max(per_layer - k * expert, 0.0),  # not -1e-19 when expert is capped
        "expert_s": expert,
        "copy_s": beyond_read + (reference.per_read_s if reference is not None else 0.0),
        "sync_step_s": fit.coef["sync_step_s"],
        "host_step_s": fit.coef["host_step_s"],
        "host_expert_s": fit.coef["host_extra_s"] + expert,
        "install_s": fit.coef["install_s"] if install_s is None else max(install_s, 0.0),
        "host_read_drag": max(host_read_drag, 0.0),
        "background_read_drag": max(background_read_drag, 0.0),
        "background_start_s": 0.0,
    }
    seconds["host_read_s"] = seconds["copy_s"]  # unless the host runs read at their own speed
    if host_runs is not None:

        def at_disk(clocks: Sequence[DiskClock]) -> list[float] | None:  # each run's copy
            if reference is None or not clocks:
                return None
            return [copy_at_disk(seconds["copy_s"], reference, c) for c in clocks]

        if reference is not None and host_clocks:
            # the host's reads at the host runs' own speed: back to back, they read faster
            # than the copies (docs/pricing.md)
            pooled = DiskClock.pooled(host_clocks)
            seconds["host_read_s"] = copy_at_disk(seconds["copy_s"], reference, pooled)
        seconds["host_step_s"], seconds["host_expert_s"] = host_terms_by_pricing(
            seconds, host_runs, at_disk(host_clocks)
        )
        if admission_runs:
            seconds["background_start_s"] = term_by_pricing(
                seconds, "background_start_s", admission_runs, at_disk(admission_clocks)
            )
    return seconds


def _host_run_costs(seconds: dict[str, float], copy_s: float, **terms: float) -> UnitCosts:
    """A host run's costs for the pricing of its own counts: one processor, the host's reads
    on the link, every read (copy or host's) at the run's own `copy_s`, `terms` replaced."""
    return UnitCosts(**{**seconds, **terms, "copy_s": copy_s, "host_read_s": copy_s},
                     concurrent_host=False, host_reads_link=True)  # fmt: skip


def term_by_pricing(
    seconds: dict[str, float],
    term: str,
    runs: Sequence[tuple[np.ndarray, np.ndarray]],
    run_copy_s: Sequence[float] | None = None,
) -> float:
    """The value of `term` (`host_expert_s`, `host_step_s`, `background_start_s`) at which the
    pricing (one processor, the host's reads on the link: `moesub.pricing`) of calibration
    runs' own counts (delay 1) takes their measured mean time per token, over all their tokens
    as the linear fit pools its runs, by bisection (the price grows with it; 0 when the runs
    took less than the rest of their price). The engine overlaps the host's reads with the fast
    path, and slows the fast path while the link reads, so the host's time is not linear in the
    counts, and the linear fit's terms would price a policy with other counts per layer wrong;
    whether a batch of background copies starts the idle lane depends on when the earlier ones
    end (docs/pricing.md). `run_copy_s` (one per run): each run's reads priced at its own copy
    time (default `seconds["copy_s"]` for all)."""
    if not runs:
        raise ValueError(f"{term} by pricing: no runs")
    copies = [seconds["copy_s"]] * len(runs) if run_copy_s is None else list(run_copy_s)
    if len(copies) != len(runs):
        raise ValueError(f"{term} by pricing: {len(copies)} copy times for {len(runs)} runs")
    measured = float(np.concatenate([np.asarray(w, float) for w, _ in runs]).mean())
    tokens = sum(len(w) for w, _ in runs)

    def excess(value: float) -> float:  # priced minus measured, mean seconds per token
        priced = 0.0
        for (_, counts), copy_s in zip(runs, copies, strict=True):
            u = _host_run_costs(seconds, copy_s, **{term: value})
            priced += float(price_stream(counts, 1, u).token_s.sum())
        return priced / tokens - measured

    if excess(0.0) >= 0.0:
        return 0.0
    hi = max(seconds[term], 1e-6)
    for _ in range(64):
        if excess(hi) >= 0.0:
            break
        hi *= 2.0
    else:
        raise ValueError(f"{term} by pricing: the runs do not exercise it")
    lo = 0.0
    for _ in range(60):  # to ~1e-18 of `hi`: as exact as the floats
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) < 0.0 else (lo, mid)
    return hi


def host_terms_by_pricing(
    seconds: dict[str, float],
    runs: Sequence[tuple[np.ndarray, np.ndarray]],
    run_copy_s: Sequence[float] | None = None,
    cut: float = 6.0,
) -> tuple[float, float]:
    """`(host_step_s, host_expert_s)` at which the pricing of the host runs (as
    `term_by_pricing`) takes their measured mean time per token and follows their tokens' time
    per step with host experts: the priced tokens' residuals have mean 0 and no covariance with
    the tokens' host steps beyond what their count of host experts explains. A step that hands
    k experts to the host costs once, which a per-expert term spreads over its experts; the
    linear fit cannot split the two where the host's reads hide behind the fast path. Newton's
    method on those two conditions (the price is piecewise linear in both), from the step at 0;
    tokens beyond `cut` robust standard deviations of the residuals there (another process took
    the CPU) left out. The step is 0 where the runs cannot tell it from the experts (every step
    with host experts had as many) or where it would be negative; the expert 0 where it would
    be."""
    expert0 = term_by_pricing({**seconds, "host_step_s": 0.0}, "host_expert_s", runs, run_copy_s)
    counts = [np.asarray(c) for _, c in runs]
    host = np.concatenate([c[..., _F["host"]] for c in counts])  # (n, L)
    steps = (host > 0).sum(axis=1).astype(float)  # (n,)
    ones_host = np.stack([np.ones(len(steps)), host.sum(axis=1).astype(float)], 1)  # (n, 2)
    if np.linalg.matrix_rank(np.column_stack([ones_host, steps])) < 3:
        return 0.0, expert0
    wall = np.concatenate([np.asarray(w, float) for w, _ in runs])
    copies = [seconds["copy_s"]] * len(runs) if run_copy_s is None else list(run_copy_s)

    def residual(step: float, expert: float) -> np.ndarray:  # (n,) priced minus measured
        priced = []
        for c, copy_s in zip(counts, copies, strict=True):
            u = _host_run_costs(seconds, copy_s, host_step_s=step, host_expert_s=expert)
            priced.append(price_stream(c, 1, u).token_s)
        return np.concatenate(priced) - wall

    r = residual(0.0, expert0)
    mad = 1.4826 * float(np.median(np.abs(r - np.median(r))))
    keep = np.abs(r - np.median(r)) <= cut * max(mad, 1e-12)
    # the steps' variation that the host's count does not explain: what tells a step from its
    # experts (a token's steps alone move with its experts, which the mean already holds to)
    a = ones_host[keep]
    x = steps[keep] - a @ np.linalg.lstsq(a, steps[keep], rcond=None)[0]

    def conditions(theta: np.ndarray) -> np.ndarray:
        rk = residual(*theta)[keep]
        return np.array([rk.mean(), (rk * x).mean()])

    theta = np.array([0.0, expert0])
    delta = max(expert0, float(wall.mean()) * 1e-3, 1e-9) * 1e-2
    for _ in range(20):
        g = conditions(theta)
        jac = np.stack([(conditions(theta + d) - g) / delta for d in np.eye(2) * delta], 1)
        if abs(np.linalg.det(jac)) < 1e-300:
            break
        moved = np.maximum(theta + np.linalg.solve(jac, -g), 0.0)  # priced: never negative
        done = np.all(np.abs(moved - theta) <= 1e-9 * max(float(moved.max()), 1e-12))
        theta = moved
        if done or not np.isfinite(theta).all():
            break
    host_step, expert = float(theta[0]), float(theta[1])
    if not (np.isfinite(host_step) and np.isfinite(expert)) or host_step <= 0.0:
        return 0.0, expert0
    if expert <= 0.0:  # the step alone, at the mean
        return term_by_pricing({**seconds, "host_expert_s": 0.0}, "host_step_s", runs,
                               run_copy_s), 0.0  # fmt: skip
    return host_step, expert


def run_errors(
    runs: Mapping[str, Sequence[tuple[np.ndarray, np.ndarray]]],
    costs: UnitCosts,
    delays: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Each mechanism's runs (`(wall_s (T,), counts (T, L, F))`, one stream each) priced at
    `costs` against their measured time, pooled over its tokens: price / measured - 1 (the
    sign of `sim_rel_error`). The fit's error on the very runs it was fitted to: its terms are
    shared by every mechanism and its outlier cut leaves some tokens out, so a mechanism the
    terms price under here prices a policy that does the same under too. `delays`: each
    mechanism's admission delay (default 1)."""
    out = {}
    for name, parts in runs.items():
        if not parts:
            raise ValueError(f"run errors: no runs of {name}")
        delay = (delays or {}).get(name, 1)
        priced = sum(float(price_stream(c, delay, costs).token_s.sum()) for _, c in parts)
        measured = sum(float(np.sum(w)) for w, _ in parts)
        out[name] = priced / measured - 1.0
    return out
