"""Every test the analysis reports, its family, the family's multiplicity adjustment, and the
direction of each result in words.

A part that tests something returns `StatTest` records: what is compared, the hypothesis in words
and the sign it predicts (or 0: it predicts no effect), the estimate with its two-sided interval,
the two-sided p-value and a minimum detectable effect (a normal-approximation sensitivity
figure, `moesub.stats.power`).
`FAMILY` names the family of each kind of test; a new kind is one line there:

- `pre-registered`: the tests of the study's claims (`moesub.stats.claims`) and the factorial
  Experiment B's pooled contrasts; Holm's step-down adjustment, which holds the chance of any
  false rejection in the family at `alpha`;
- `exploratory`: every other test with a p-value; Benjamini-Hochberg, which holds the expected
  share of false rejections among the rejections at `alpha`.

Families are per model (each model is its own study). A test without a p-value (an invalid
design, a missing twin) stays in the table with its reason and is not counted in its family.

Direction, from the adjusted p-value and the sign of the estimate: "supports" (adjusted p <
alpha, the sign the hypothesis predicts), "evidence against the hypothesis" (adjusted p <
alpha, the other sign; for a hypothesis of no effect, either sign), else "no detectable effect"
with the MDE beside it. The p-values are two-sided and each comes from the test its interval
inverts, so an unadjusted interval that excludes 0 has p < 1 - ci_level.

Entry point: `family_table(tests, alpha) -> pd.DataFrame` (`tests.parquet`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from moesub.stats.intervals import Interval

PRE_REGISTERED = "pre-registered"
EXPLORATORY = "exploratory"
ADJUSTMENT = {PRE_REGISTERED: "Holm", EXPLORATORY: "Benjamini-Hochberg"}
# the family of every kind of test (`StatTest.kind`); adding a kind of test is one line here
FAMILY = {
    "dppl_contrast": PRE_REGISTERED,  # Δppl substitute_all − rule_015 (the 0.15 rule)
    "mass_hypothesis": PRE_REGISTERED,  # r(mass, Δppl) across the fetch-first policies
    "expb_primary": PRE_REGISTERED,  # Experiment B, heavy − light at a design's primary m*
    "admission_study": PRE_REGISTERED,  # the study's admission policies vs their exact twins
    "mass_within_clusters": EXPLORATORY,  # r(mass, Δppl) within clusters of mass
    "expb_target": EXPLORATORY,  # Experiment B at the other target masses
    "expb_factorial_main": PRE_REGISTERED,  # factorial: weight at fixed rank, rank at fixed weight
    "expb_factorial_bucket": EXPLORATORY,  # factorial: the same per rank bucket / weight band
    "admission_other": EXPLORATORY,  # other admission policies vs their exact twins
    "admission_profile": EXPLORATORY,  # admission gain early / late after a topic change
    "per_input": EXPLORATORY,  # r(mass, ΔNLL) across streams or documents, per policy
    "generation_accuracy": EXPLORATORY,  # accuracy vs the baseline (McNemar)
    "generation_agreement": EXPLORATORY,  # r(mass, agreement) across problems
    "allocation": EXPLORATORY,  # Δppl planned − uniform per-layer slots (same total)
    "degeneration": EXPLORATORY,  # a continuation's repetition / loops vs the baseline's
}
SUPPORTS = "supports"
AGAINST = "evidence against the hypothesis"
NO_EFFECT = "no detectable effect"
NOT_TESTED = "not tested"


@dataclass(frozen=True)
class StatTest:
    """One test: `kind` (a `FAMILY` key), `name` (what is compared), `hypothesis` (in words)
    and `expected` (+1 / -1: the sign of `estimate` it predicts; 0: it predicts no effect),
    `estimand` (what `estimate` is, with units), the two-sided interval and p-value, the
    t-based sensitivity interval, the MDE and the smallest p the design can reach, n units;
    `reason` when there is no p-value
    (`measured` False when the run lacks the data, e.g. a twin that was not emulated);
    `sensitivity`: a line on a second analysis of the same hypothesis (not in the family)."""

    kind: str
    name: str
    hypothesis: str
    expected: int
    estimand: str
    fraction: float | None = None
    estimate: float | None = None
    ci_lo: float | None = None
    ci_hi: float | None = None
    ci_method: str | None = None
    t_ci_lo: float | None = None
    t_ci_hi: float | None = None
    p_value: float | None = None
    p_method: str | None = None
    mde: float | None = None
    min_p: float | None = None
    n_units: int | None = None
    unit: str = "streams"
    sensitivity: str | None = None
    reason: str | None = None
    measured: bool = True  # False: this run has not the data the test needs (`reason` says)

    def __post_init__(self) -> None:
        if self.kind not in FAMILY:
            raise ValueError(f"test kind {self.kind!r} has no family; add it to FAMILY")
        if self.expected not in (1, -1, 0):
            raise ValueError(f"test {self.name!r}: expected must be +1, -1 or 0")


def from_interval(iv: Interval) -> dict[str, Any]:
    """A bootstrapped interval's fields of a `StatTest` (its p-value asked with `null=0`)."""
    return {
        "estimate": iv.estimate,
        "ci_lo": iv.ci_lo,
        "ci_hi": iv.ci_hi,
        "ci_method": f"stream bootstrap, {iv.method}",
        "t_ci_lo": iv.t_lo,
        "t_ci_hi": iv.t_hi,
        "p_value": iv.p_value,
        "p_method": "inverts the bootstrap interval" if iv.p_value is not None else None,
    }


def holm(p: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values: the i-th smallest times (m - i + 1), made monotone."""
    p = np.asarray(p, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")
    adj = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adj
    return out


def benjamini_hochberg(p: Sequence[float]) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values: the i-th smallest times m / i, made monotone from
    the largest down."""
    p = np.asarray(p, dtype=float)
    m = p.size
    order = np.argsort(p, kind="stable")
    scaled = p[order] * m / np.arange(1, m + 1)
    adj = np.minimum(1.0, np.minimum.accumulate(scaled[::-1])[::-1])
    out = np.empty(m)
    out[order] = adj
    return out


ADJUST = {"Holm": holm, "Benjamini-Hochberg": benjamini_hochberg}


def direction(p_adjusted: float | None, estimate: float | None, expected: int, alpha: float):
    """`SUPPORTS`, `AGAINST`, `NO_EFFECT` or `NOT_TESTED` (module doc)."""
    if p_adjusted is None or estimate is None or not np.isfinite(p_adjusted):
        return NOT_TESTED
    if p_adjusted >= alpha:
        return NO_EFFECT
    return SUPPORTS if expected != 0 and np.sign(estimate) == expected else AGAINST


def family_table(tests: Sequence[StatTest], alpha: float) -> pd.DataFrame:
    """One row per test: its fields, `family`, `adjustment`, `family_size` (tests with a
    p-value in the family), `p_adjusted`, `direction`; ordered by family, then as given."""
    if not tests:
        return pd.DataFrame()
    df = pd.DataFrame([asdict(t) for t in tests])
    df.insert(0, "family", df["kind"].map(FAMILY))
    df["adjustment"] = df["family"].map(ADJUSTMENT)
    df["family_size"] = 0
    df["p_adjusted"] = np.nan
    for family, g in df.groupby("family"):
        tested = g.index[g["p_value"].notna()]
        df.loc[g.index, "family_size"] = len(tested)
        if len(tested):
            df.loc[tested, "p_adjusted"] = ADJUST[ADJUSTMENT[family]](df.loc[tested, "p_value"])
    df["direction"] = [
        direction(None if pd.isna(pa) else pa, None if pd.isna(e) else e, x, alpha)
        for pa, e, x in zip(df["p_adjusted"], df["estimate"], df["expected"], strict=True)
    ]
    order = {PRE_REGISTERED: 0, EXPLORATORY: 1}
    return df.sort_values("family", key=lambda f: f.map(order), kind="stable", ignore_index=True)


def families(table: pd.DataFrame, alpha: float) -> list[dict[str, Any]]:
    """Per family: its adjustment, size, alpha and how many tests it rejects
    (`analysis.json["families"]`)."""
    if table.empty:
        return []
    return [
        {
            "family": family,
            "adjustment": ADJUSTMENT[family],
            "alpha": alpha,
            "n_tests": int(g["p_value"].notna().sum()),
            "n_rejected": int((g["p_adjusted"] < alpha).sum()),
            "kinds": sorted(set(g["kind"])),
        }
        for family, g in table.groupby("family", sort=False)
    ]
