"""One ranking: the candidates of one (hardware, cache size, time source), the choice and the
tie rule.

A ranking never mixes time sources: its times are all the simulator's (one hardware profile's
pricing) or all one engine device's. Each time carries an interval that says how far it can
be trusted (`Timing`):

- engine: the distribution-free interval of the median per token (order statistics over the
  tokens measured, `moesub.stats`);
- simulator: the pricing is deterministic (the same counts give the same seconds), so its
  uncertainty is the model's error, measured where an engine ran the same policies: the engine
  bench's `sim_rel_error` e_p per policy. A policy's true time is estimate / (1 + e), and a
  common error cancels in a ratio; so each estimate t gets [t / (1 + max e), t / (1 + min e)],
  and two estimates are told apart only when their ratio exceeds (1 + max e) / (1 + min e).
  On this machine the error is the bench's as measured: its disk's drift between runs is part
  of what this machine's estimates miss. A documented profile's is the bench's at each run's
  disk speed (`sim_rel_error_at_run_disk`): the pricing's own error, without the drift of this
  machine's disk, which a GPU host's link does not share (`profile_timing`).
  Without an engine bench the interval is the point.

Speedups compare with the baseline in the same ranking; their interval is the interval of the
two times' intervals: [base_lo / t_hi, base_hi / t_lo].

The choice (`choose`): among the candidates not excluded, `within_budget` are those whose Δppl
upper bound *on the screen half* of the streams is within the budget, `lossless` those with
Δppl exactly 0 (on every stream, or by construction). Of each set the fastest is found; every
qualifying candidate whose time interval overlaps the fastest's is tied with it, and the tie
goes to the simpler policy: fewer non-default fields (`candidates.non_default_fields`), then
the faster, then the name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class Timing:
    """How a ranking's times are uncertain (module doc). `lo_factor`, `hi_factor`: a simulator
    estimate t lies in [t * lo_factor, t * hi_factor]; engine times carry their own interval."""

    method: str  # "engine median interval" | "simulator model error" | "none"
    text: str
    lo_factor: float = 1.0
    hi_factor: float = 1.0
    rel_error_min: float | None = None
    rel_error_max: float | None = None
    bench_device: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "text": self.text,
            "rel_error_min": self.rel_error_min,
            "rel_error_max": self.rel_error_max,
            "bench_device": self.bench_device,
        }


ENGINE_TIMING = Timing(
    "engine median interval",
    "the engine's median time per token with its distribution-free interval (order "
    "statistics over the tokens measured)",
)


# the bench's error columns, as each timing quotes them
BENCH_ERRORS = {
    "sim_rel_error": "as measured",
    "sim_rel_error_at_run_disk": "each run priced at its disk's speed",
}


def simulator_timing(engine_bench: pd.DataFrame, column: str = "sim_rel_error") -> Timing:
    """The simulator's model error from the engine bench (module doc): its `column`
    (`BENCH_ERRORS`) over the policies of one device (a CUDA one if any ran, else the first by
    name)."""
    need = {"device", column}
    if engine_bench.empty or not need <= set(engine_bench.columns):
        return Timing(
            "none",
            "simulator estimate: the pricing is deterministic, and no engine bench measured "
            "its error, so times carry no interval",
        )
    rows = engine_bench[np.isfinite(engine_bench[column].astype(float))]
    if rows.empty:
        return simulator_timing(rows.iloc[:0], column)
    devices = sorted(rows["device"].astype(str).unique(), key=lambda d: (d != "cuda", d))
    e = rows[rows["device"].astype(str) == devices[0]][column].astype(float)
    lo, hi = float(e.min()), float(e.max())
    return Timing(
        "simulator model error",
        f"simulator estimate: the pricing is deterministic; its error against the engine bench "
        f"on {devices[0]} ({BENCH_ERRORS[column]}) ranged {lo:+.1%} to {hi:+.1%} over {len(e)} "
        f"policies, so an estimate t stands for [t / {1 + hi:.3f}, t / {1 + lo:.3f}] and two "
        f"estimates tie unless their ratio exceeds {(1 + hi) / (1 + lo):.3f}",
        lo_factor=1.0 / (1.0 + hi),
        hi_factor=1.0 / (1.0 + lo),
        rel_error_min=lo,
        rel_error_max=hi,
        bench_device=devices[0],
    )


def profile_timing(measured: Timing, hardware: str) -> Timing:
    """A documented profile's timing: its constants are estimates (docs/hardware.md), never
    measured here, so the only error figure is the pricing's own on this machine (`measured`:
    the bench's at each run's disk speed, module doc), carried over as the interval and said to
    be a lower bound on the profile's error."""
    return replace(
        measured,
        method=f"{measured.method} (profile estimate)",
        text=f"priced on the documented profile {hardware!r}, whose constants are estimates not "
        f"measured on this machine; {measured.text} (on this machine: a lower bound on the "
        "profile's error)",
    )


def with_intervals(times: pd.DataFrame, timing: Timing) -> pd.DataFrame:
    """`times` (`candidates.TIME_COLUMNS` of one ranking) with `time_lo_s, time_hi_s`: the
    engine's own interval, else the estimate times the timing's factors."""
    t = times["time_per_token_s"].astype(float)
    if timing is ENGINE_TIMING:
        lo = times["time_ci_lo"].astype(float).fillna(t)
        hi = times["time_ci_hi"].astype(float).fillna(t)
    else:
        lo, hi = t * timing.lo_factor, t * timing.hi_factor
    return times.assign(time_lo_s=lo, time_hi_s=hi)


def speedups(ranked: pd.DataFrame, reference: str, column: str) -> pd.DataFrame:
    """`column` (and `_lo`, `_hi`): each candidate's speedup vs `reference` in this ranking
    (module doc); NaN where the reference has no time here."""
    ref = ranked[ranked["policy"] == reference]
    if ref.empty:
        return ranked.assign(**{column: np.nan, f"{column}_lo": np.nan, f"{column}_hi": np.nan})
    b = ref.iloc[0]
    return ranked.assign(
        **{
            column: b["time_per_token_s"] / ranked["time_per_token_s"],
            f"{column}_lo": b["time_lo_s"] / ranked["time_hi_s"],
            f"{column}_hi": b["time_hi_s"] / ranked["time_lo_s"],
        }
    )


@dataclass(frozen=True)
class Choice:
    """A choice of one ranking: the row chosen, the fastest qualifying candidate and the
    candidates tied with it (the tie rule chose among them), or why there is none."""

    row: dict[str, Any] | None
    reason: str | None = None
    fastest: str | None = None
    tied: tuple[str, ...] = ()


def fastest_simplest(q: pd.DataFrame) -> Choice:
    """The tie rule (module doc) over the qualifying candidates `q` (non-empty)."""
    q = q.sort_values(["time_per_token_s", "policy"])
    fastest = q.iloc[0]
    tied = q[q["time_lo_s"] <= fastest["time_hi_s"]]
    tied = tied.assign(_n=[len(f) for f in tied["non_default_fields"]])
    pick = tied.sort_values(["_n", "time_per_token_s", "policy"]).iloc[0].drop("_n")
    return Choice(pick.to_dict(), None, str(fastest["policy"]), tuple(sorted(tied["policy"])))


def choose(ranked: pd.DataFrame, budget_pct: float) -> dict[str, Choice]:
    """{"within_budget": Choice, "lossless": Choice} of one ranking's candidates `ranked`
    (quality columns, times with intervals, `excluded`)."""
    ok = ranked[ranked["excluded"].isna()]
    if ok.empty:
        reasons = sorted({str(e) for e in ranked["excluded"].dropna()})
        why = "no candidate: " + ("; ".join(reasons) if reasons else "no policy at this size")
        return {"within_budget": Choice(None, why), "lossless": Choice(None, why)}
    within = ok[ok["screen_dppl_ci_hi"].astype(float) <= budget_pct]
    if within.empty:
        lowest = ok.sort_values(["screen_dppl_ci_hi", "policy"]).iloc[0]
        w = Choice(
            None,
            f"no candidate's Δppl upper CI bound on the screen half is <= {budget_pct:g}% "
            f"(lowest: {lowest['policy']} at {float(lowest['screen_dppl_ci_hi']):.3g}%)",
        )
    else:
        w = fastest_simplest(within)
    exact = ok[ok["lossless"].eq(True)]
    lossless = (
        fastest_simplest(exact)
        if not exact.empty
        else Choice(None, "no candidate has Δppl exactly 0 (on every stream or by construction)")
    )
    return {"within_budget": w, "lossless": lossless}
