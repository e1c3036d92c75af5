"""Quality: Δppl and substituted mass per policy and fraction, with intervals.

Δppl % (`moesub.metrics.dppl_pct`, the project's one Δppl) is taken against `fetch_every_miss`
(params `baseline`) emulated at the same cache fraction, or, if that run is absent, the captured
exact NLL (identical by construction).

Per policy and fraction (`quality`): Δppl % and the mean substituted mass per token-layer
(emulate's `mass` is the sum over the L layers; `load` divides it by L), each with a stream
bootstrap BCa interval and the bootstrap bias, and `dppl_mde_pct`: the smallest Δppl a
one-sided paired test at `alpha` over the streams detects with probability `power`, from the
per-stream standard deviation of the mean ΔNLL (`moesub.stats.power.paired_mde`; a
normal-approximation sensitivity figure).

The 0.15 rule's contrast (`rule_contrast`, the study's first claim): Δppl(substitute_all) −
Δppl(rule_015) in percentage points, both from the same stream resamples (paired), with its BCa
interval, the t-based sensitivity interval, the two-sided p-value of 0 that the interval
inverts and the MDE; one pre-registered `StatTest` per fraction where both ran against a baseline.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from moesub.metrics import dppl_pct
from moesub.policy import STATUS_NAMES
from moesub.stats.intervals import Interval, rng_for, stream_bootstrap
from moesub.stats.load import missing
from moesub.stats.multiplicity import StatTest, from_interval
from moesub.stats.params import AnalysisParams
from moesub.stats.power import normal_mde, paired_mde
from moesub.stats.tokens import Tokens

# the study's first claim: substituting freely costs more than the 0.15 rule
RULE_CONTRAST = ("substitute_all", "rule_015")


def ratio_stat(num: np.ndarray, den: np.ndarray, transform=None):
    """The statistic `transform(w @ num / w @ den)` of stream weights w (R, S), for
    `stream_bootstrap`: a token-weighted mean over the resampled streams."""

    def stat(w: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            value = (w @ num) / (w @ den)
        return transform(value) if transform is not None else value

    return stat


class Quality(NamedTuple):
    """`streams`: per (name, fraction, stream) sums of emulate against the baseline (n_tok,
    sum_mass, n_nll, sum_dnll, ..., the status counts); `table`: one row per (policy,
    fraction); `status`: the part's `analysis.json["parts"]` entry."""

    streams: pd.DataFrame
    table: pd.DataFrame
    status: dict[str, Any]


def quality(tokens: Tokens, p: AnalysisParams) -> Quality:
    """Per-stream aggregates of emulate vs the baseline (`emu`, `emu_base`), and per-policy
    totals with CIs."""
    if not tokens.emulated:
        return Quality(pd.DataFrame(), pd.DataFrame(), missing("no emulate artefacts"))
    counts = ", ".join(f'sum(e."{n}") AS "{n}"' for n in STATUS_NAMES)
    ps = tokens.db.execute(
        f"""
        SELECT e.name, e.fraction, e.stream,
               count(*) AS n_tok, sum(e.mass) AS sum_mass,
               count(e.nll - b.nll_b) AS n_nll,
               coalesce(sum(e.nll - b.nll_b), 0) AS sum_dnll,
               coalesce(sum(CASE WHEN b.nll_b IS NOT NULL THEN e.nll END), 0) AS sum_nll,
               coalesce(sum(CASE WHEN e.nll IS NOT NULL THEN b.nll_b END), 0) AS sum_nll_b,
               count(e.nll) AS n_nll_own, coalesce(sum(e.nll), 0) AS sum_nll_own, {counts}
        FROM emu e LEFT JOIN emu_base b
          ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
        GROUP BY ALL ORDER BY e.name, e.fraction, e.stream
        """
    ).df()
    rows = []
    for (name, frac), g in ps.groupby(["name", "fraction"], sort=True):
        rows.append(policy_quality(g, name, float(frac), p))
    no_base = [f for f, s in tokens.dppl_base.items() if s == "none"]
    status = (
        {"status": "ok"}
        if not no_base
        else {
            "status": "partial",
            "reason": f"no {p.baseline} run and no capture tokens at fraction(s) "
            f"{no_base}: Δppl undefined there",
        }
    )
    return Quality(ps, pd.DataFrame(rows), status)


def policy_quality(g: pd.DataFrame, name: str, frac: float, p: AnalysisParams) -> dict:
    """One quality row from a policy's per-stream sums `g` (rows of `Quality.streams`)."""
    n_s = len(g)
    n_tok, n_nll = g["n_tok"].to_numpy(float), g["n_nll"].to_numpy(float)
    sum_mass, sum_dnll = g["sum_mass"].to_numpy(float), g["sum_dnll"].to_numpy(float)
    calls = float(sum(g[c].sum() for c in STATUS_NAMES))
    has_base = n_nll.sum() > 0
    nll_n = n_nll.sum() if has_base else g["n_nll_own"].sum()
    nll_sum = g["sum_nll"].sum() if has_base else g["sum_nll_own"].sum()
    (mass,) = stream_bootstrap(
        ratio_stat(sum_mass, n_tok),
        n_s,
        p.n_boot,
        rng_for(p.seed, "quality", "mass", name, frac),
        p.ci_level,
    )
    dppl, mde = Interval(None), None
    if has_base:
        (dppl,) = stream_bootstrap(
            ratio_stat(sum_dnll, n_nll, dppl_pct),
            n_s,
            p.n_boot,
            rng_for(p.seed, "quality", "dppl", name, frac),
            p.ci_level,
        )
        per_stream = sum_dnll[n_nll > 0] / n_nll[n_nll > 0]
        sd = float(per_stream.std(ddof=1)) if per_stream.size >= 2 else None
        mde_dnll = paired_mde(sd, int(per_stream.size), p.alpha, p.power)
        mde = float(dppl_pct(mde_dnll)) if mde_dnll is not None else None
    return {
        "policy": name,
        "fraction": frac,
        "n_streams": n_s,
        "n_tokens": int(n_tok.sum()),
        "n_nll_tokens": int(nll_n),
        "ppl": math.exp(nll_sum / nll_n) if nll_n else None,
        "ppl_base": math.exp(g["sum_nll_b"].sum() / nll_n) if has_base else None,
        "dppl_pct": dppl.estimate,
        **dppl.columns("dppl_"),
        "dppl_mde_pct": mde,
        "mass_per_token_layer": mass.estimate,
        **mass.columns("mass_"),
        "sub_rate": float(g["sub"].sum() / calls) if calls else None,
        "hit_rate": float(g["hit"].sum() / calls) if calls else None,
        "forced_rate": float(g["forced"].sum() / calls) if calls else None,
    }


def paired_dppl_difference(
    g: pd.DataFrame, a: str, b: str, p: AnalysisParams, *rng_keys: Any
) -> tuple[Interval, int] | None:
    """Δppl % of `a` − Δppl % of `b` (percentage points) at one fraction from its per-stream
    sums `g`, both from the same stream resamples (paired), with its BCa interval and the
    number of streams; None where either has no run against a baseline."""
    g = g[g["name"].isin((a, b))]
    sums = g.pivot_table(index="name", columns="stream", values=["sum_dnll", "n_nll"],
                         aggfunc="sum").fillna(0.0)  # fmt: skip
    if set(sums.index) != {a, b} or not (sums["n_nll"].sum(axis=1) > 0).all():
        return None
    dnll = sums["sum_dnll"].loc[[a, b]].to_numpy(float).T  # (S, 2)
    n = sums["n_nll"].loc[[a, b]].to_numpy(float).T  # (S, 2)

    pair = ratio_stat(dnll, n, dppl_pct)  # (R, S) -> (R, 2) Δppl of a and b

    (iv,) = stream_bootstrap(
        lambda w: np.subtract(*pair(w).T),
        len(dnll),
        p.n_boot,
        rng_for(p.seed, *rng_keys),
        p.ci_level,
        null=0.0,
    )
    return iv, len(dnll)


def rule_contrast(per_stream: pd.DataFrame, p: AnalysisParams) -> list[StatTest]:
    """Δppl(substitute_all) − Δppl(rule_015) per fraction (module doc) from the per-stream sums
    `per_stream` (`Quality.streams`); no test where either did not run against a baseline."""
    if per_stream.empty:
        return []
    a, b = RULE_CONTRAST
    tests = []
    for frac, g in per_stream.groupby("fraction", sort=True):
        found = paired_dppl_difference(g, a, b, p, "quality", "rule_contrast", frac)
        if found is None:
            continue
        iv, n_streams = found
        tests.append(
            StatTest(
                kind="dppl_contrast",
                name=f"{a} − {b}",
                hypothesis=f"{a} raises perplexity more than {b} (protecting heavy experts "
                "matters more than the count)",
                expected=1,
                estimand=f"Δppl % {a} − Δppl % {b}, percentage points",
                fraction=float(frac),
                **from_interval(iv),
                mde=normal_mde(iv.se, p.alpha, p.power),
                min_p=1.0 / p.n_boot,
                n_units=n_streams,
            )
        )
    return tests
