"""Planned per-layer slots against uniform ones: what the allocation buys, with its cost.

A planned policy (`allocation: planned`, moesub.allocation: slot counts per layer chosen on the
calibration capture, the same total) is paired with its uniform counterpart: the emulated policy
whose fields are the same apart from the allocation. Per (pair, fraction) both were emulated at:

- Δppl % of each and the paired difference planned − uniform in percentage points (both from the
  same stream resamples, `moesub.stats.quality.paired_dppl_difference`), BCa interval, the
  two-sided p-value it inverts and the MDE: one exploratory test (`allocation`), predicted < 0
  (more hits on the same total leave fewer misses to substitute);
- each one's per-layer slots (the emulate run's layout), emulated hit rate and substitution rate;
- the simulated time per token of planned over uniform on each priced hardware profile (a ratio
  of two deterministic replays of the same evaluation trace: no interval), at the study's
  profile and its range over the profiles.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd

from moesub.hardware import STUDY_PROFILE
from moesub.stats.load import FileInfo, missing
from moesub.stats.multiplicity import StatTest, from_interval
from moesub.stats.params import AnalysisParams
from moesub.stats.power import normal_mde
from moesub.stats.quality import paired_dppl_difference

HYPOTHESIS = (
    "planned per-layer slots (same total) lower Δppl: more hits leave fewer misses to substitute"
)
ESTIMAND = "Δppl % planned − Δppl % uniform, percentage points"


class Allocation(NamedTuple):
    """`table`: one row per (planned policy, fraction) (module doc); `tests`: the paired Δppl
    differences; `status`: the part's `analysis.json["parts"]` entry."""

    table: pd.DataFrame
    tests: list[StatTest]
    status: dict[str, Any]


def uniform_counterpart(policy: dict[str, Any], candidates: dict[str, Any]) -> str | None:
    """The candidate (name -> normalized policy) equal to `policy` apart from its allocation,
    with uniform slots; the first by name when several are."""

    def rest(spec: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in spec.items() if k != "allocation"}

    same = sorted(
        name
        for name, spec in candidates.items()
        if spec is not None
        and spec.get("allocation", "uniform") == "uniform"
        and rest(spec) == rest(policy)
    )
    return same[0] if same else None


def slots(meta: dict[str, Any] | None) -> str | None:
    """A run's per-layer slot counts as "145/154/105/108" (its recorded layout)."""
    capacities = ((meta or {}).get("layout") or {}).get("capacities")
    return "/".join(str(int(c)) for c in capacities) if capacities else None


def time_ratios(prices: pd.DataFrame, planned: str, uniform: str, frac: float) -> pd.Series:
    """hardware -> simulated time per token, planned / uniform, at fraction `frac`."""
    if prices.empty:
        return pd.Series(dtype=float)
    sim = prices[(prices["source"] == "simulator") & ((prices["fraction"] - frac).abs() < 1e-9)]
    t = sim.pivot_table(index="hardware", columns="policy", values="time_per_token_s")
    if planned not in t.columns or uniform not in t.columns:
        return pd.Series(dtype=float)
    return (t[planned] / t[uniform]).dropna()


def allocation(
    per_stream: pd.DataFrame,
    quality_table: pd.DataFrame,
    prices: pd.DataFrame,
    emulate: list[FileInfo],
    p: AnalysisParams,
) -> Allocation:
    """Every emulated planned policy against its emulated uniform counterpart (module doc)."""
    if per_stream.empty:
        return Allocation(pd.DataFrame(), [], missing("no emulate artefacts"))
    meta = {(i.name, i.fraction): i.meta for i in emulate}
    q = quality_table.set_index(["policy", "fraction"])
    rows, tests, unpaired = [], [], []
    for frac, g in per_stream.groupby("fraction", sort=True):
        names = sorted(g["name"].unique())
        known = {n: p.policy(n, meta.get((n, frac))) for n in names}
        for name in names:
            pol = known[name]
            if pol is None or pol.get("allocation") != "planned":
                continue
            uniform = uniform_counterpart(pol, {n: c for n, c in known.items() if n != name})
            if uniform is None:
                unpaired.append(f"{name} at fraction {float(frac):g}")
                continue
            found = paired_dppl_difference(g, name, uniform, p, "allocation", name, frac)
            if found is None:
                continue
            iv, n_streams = found
            test = StatTest(
                kind="allocation",
                name=f"{name} − {uniform}",
                hypothesis=HYPOTHESIS,
                expected=-1,
                estimand=ESTIMAND,
                fraction=float(frac),
                **from_interval(iv),
                mde=normal_mde(iv.se, p.alpha, p.power),
                min_p=1.0 / p.n_boot,
                n_units=n_streams,
            )
            tests.append(test)
            ratios = time_ratios(prices, name, uniform, float(frac))
            rows.append(
                {
                    "planned": name,
                    "uniform": uniform,
                    "fraction": float(frac),
                    "planned_slots": slots(meta.get((name, frac))),
                    "uniform_slots": slots(meta.get((uniform, frac))),
                    **{
                        f"{side}_{col}": q.loc[(pol_name, frac), col]
                        for side, pol_name in (("planned", name), ("uniform", uniform))
                        for col in ("dppl_pct", "hit_rate", "sub_rate")
                    },
                    "diff_dppl_pct": iv.estimate,
                    "diff_ci_lo": iv.ci_lo,
                    "diff_ci_hi": iv.ci_hi,
                    "diff_p": iv.p_value,
                    "diff_mde": test.mde,
                    "n_streams": n_streams,
                    "time_ratio_study": ratios.get(STUDY_PROFILE),
                    "time_ratio_min": ratios.min() if len(ratios) else None,
                    "time_ratio_max": ratios.max() if len(ratios) else None,
                    "n_profiles": len(ratios),
                }
            )
    note = (
        {"note": "no emulated uniform counterpart for " + ", ".join(unpaired)} if unpaired else {}
    )
    if not rows:
        why = "no emulated planned policy with its uniform counterpart"
        return Allocation(pd.DataFrame(), [], {**missing(why), **note})
    return Allocation(pd.DataFrame(rows), tests, {"status": "ok", **note})
