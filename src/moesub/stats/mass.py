"""The mass hypothesis: across policies that fetch the router's first choice, Δppl grows with
the substituted gate mass (the study: Pearson r ~ 0.92).

Point set, per cache fraction (every emulated policy is a row of `mass_points`, `used` says
whether it is a point of r and `why_out` why not):

- the group "fetches first choice": rules `threshold` and `first_choice` (any eviction, beta);
- lossless policies are left out: rules `fetch_all` / `host_compute`, and light misses computed
  on the host (`moesub.stats.design.lossless`): their mass and Δppl are 0 by construction, so
  each adds the same (0, 0) point, which sets r's size without saying anything about mass;
  so is a policy that substituted nothing on these streams (measured mass 0);
- r is reported only over at least `mass_min_points` such points: over fewer, one or two
  points decide it (a user's run printed r = -1 over 5 policies, 4 of them lossless);
- `substitute_all` (the router's first choice substituted too) is not a point of r; it is set
  against the line through the points (`substitute_all` entry): its mass, Δppl, the line's
  prediction at its mass and the used point nearest in mass. With more mass than a point and
  many times its Δppl, it shows what r over the fetch-first rules cannot: which experts are
  substituted matters, not only how much mass.

Clusters: the used masses sorted, a new cluster starts where the gap to the previous one is
more than `mass_cluster_gap` times the range of the masses. The within-cluster r is Pearson's r
of mass and Δppl each taken from its cluster's mean: how far r holds inside the clusters rather
than between them. Clusters are found on the full sample and kept in every resample.

Intervals: the streams are resampled (the same resample for every policy), each policy's mass
and Δppl recomputed, then r and the within-cluster r: BCa (basic where BCa is undefined), the
bootstrap bias, a t-based sensitivity interval (jackknife SE, clipped to [-1, 1]) and the
two-sided p-value of r = 0 that the interval inverts. The interval is conditional on the policy
set: the policies are nested sweeps of one another (tau, beta) chosen in the config, not a
sample of policies, so no parametric p-value or Fisher-z interval stands across them.
Tests: r is the pre-registered `mass_hypothesis` test, the within-cluster r an exploratory one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from moesub.metrics import dppl_pct
from moesub.policy import Policy
from moesub.slots import policy_fields
from moesub.stats.design import lossless
from moesub.stats.intervals import Interval, correlation, rng_for, rowwise_pearson, stream_bootstrap
from moesub.stats.load import FileInfo, missing
from moesub.stats.multiplicity import StatTest, from_interval
from moesub.stats.params import AnalysisParams
from moesub.stats.power import normal_mde

FETCH_FIRST = "fetches first choice"
SUBSTITUTE_FIRST = "substitutes first choice"
NEVER = "never substitutes"
GROUPS = {  # rule -> group
    "threshold": FETCH_FIRST,
    "first_choice": FETCH_FIRST,
    "substitute_all": SUBSTITUTE_FIRST,
    "fetch_all": NEVER,
    "host_compute": NEVER,
}


class MassHypothesis(NamedTuple):
    """`points`: per (fraction, policy) its group, mass, Δppl, `used`, `why_out`, `cluster`;
    `results`: per fraction the point set, r, the clusters, the within-cluster r and the
    substitute_all entry (`analysis.json["mass_hypothesis"]`); `tests`; `status`."""

    points: pd.DataFrame
    results: list[dict[str, Any]]
    tests: list[StatTest]
    status: dict[str, Any]


def mass_hypothesis(
    per_stream: pd.DataFrame, emulate: list[FileInfo], p: AnalysisParams
) -> MassHypothesis:
    """The mass hypothesis per fraction (module doc) from the per-stream sums `per_stream`
    (`Quality.streams`); `emulate`: the runs' files (their metadata names a policy the config
    does not)."""
    if per_stream.empty or not (per_stream["n_nll"] > 0).any():
        why = "needs emulate artefacts and a baseline NLL (fetch_every_miss or capture)"
        return MassHypothesis(pd.DataFrame(), [], [], missing(why))
    meta_by_name = {i.name: i.meta for i in emulate}
    points, results, tests = [], [], []
    for frac, gf in per_stream.groupby("fraction", sort=True):
        gf = gf[gf["n_nll"] > 0]
        names = sorted(gf["name"].unique())
        policies = {n: p.policy(n, meta_by_name.get(n)) for n in names}
        names = [n for n in names if policies[n] is not None and policies[n]["rule"] in GROUPS]
        streams = np.sort(gf["stream"].unique())
        # (P, S) per-stream sums; streams a policy lacks contribute nothing to it
        mats = {
            c: gf.pivot_table(index="name", columns="stream", values=c, aggfunc="sum")
            .reindex(index=names, columns=streams)
            .fillna(0.0)
            .to_numpy(float)
            for c in ("n_tok", "sum_mass", "n_nll", "sum_dnll")
        }
        mass, dppl = mass_dppl(mats, np.ones((1, len(streams))))
        pts = pd.DataFrame(
            {
                "fraction": float(frac),
                "policy": names,
                "group": [GROUPS[policies[n]["rule"]] for n in names],
                "mass_per_token_layer": mass[0],
                "dppl_pct": dppl[0],
            }
        )
        pts["why_out"] = [why_out(policies[n], m) for n, m in zip(names, mass[0], strict=True)]
        pts["used"] = pts["why_out"].isna()
        pts["cluster"] = clusters(
            pts["mass_per_token_layer"].where(pts["used"]), p.mass_cluster_gap
        )
        res, t = correlation_result(pts, mats, len(streams), float(frac), p)
        res["substitute_all"] = substitute_all_entry(pts)
        points.append(pts)
        results.append(res)
        tests.extend(t)
    return MassHypothesis(pd.concat(points, ignore_index=True), results, tests, {"status": "ok"})


def mass_dppl(mats: dict[str, np.ndarray], w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mass per token-layer and Δppl % of each policy under stream weights w (R, S): 2 x (R, P)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mass = (w @ mats["sum_mass"].T) / (w @ mats["n_tok"].T)
        dppl = dppl_pct((w @ mats["sum_dnll"].T) / (w @ mats["n_nll"].T))
    return mass, dppl


def why_out(policy: dict[str, Any], mass: float) -> str | None:
    """Why a policy is not a point of r (module doc), or None."""
    group = GROUPS[policy["rule"]]
    if group == SUBSTITUTE_FIRST:
        return "substitutes the first choice too (set against the line instead)"
    if group == NEVER or lossless(Policy.from_dict(policy_fields(policy))):
        return "lossless: mass and Δppl are 0 by construction"
    if not mass > 0:
        return "substituted nothing on these streams (mass 0)"
    return None


def clusters(mass: pd.Series, gap: float) -> pd.Series:
    """Cluster number per point (NaN for a point not used): sorted by mass, a new cluster where
    the gap to the previous mass exceeds `gap` times the range (module doc)."""
    used = mass.dropna().sort_values(kind="stable")
    if used.empty:
        return pd.Series(np.nan, index=mass.index)
    span = float(used.iloc[-1] - used.iloc[0])
    starts = np.r_[False, np.diff(used.to_numpy()) > gap * span]  # nothing starts when span 0
    return pd.Series(np.cumsum(starts), index=used.index, dtype=float).reindex(mass.index)


def within(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """x (R, P) with each cluster's mean (over its columns, per row) taken off."""
    out = x.copy()
    for c in np.unique(labels):
        cols = labels == c
        out[:, cols] -= out[:, cols].mean(axis=1, keepdims=True)
    return out


def correlation_result(
    pts: pd.DataFrame, mats: dict[str, np.ndarray], n_streams: int, frac: float, p: AnalysisParams
) -> tuple[dict[str, Any], list[StatTest]]:
    """r and the within-cluster r over the used points of one fraction, with their intervals,
    and their tests."""
    used = pts[pts["used"]]
    labels = used["cluster"].to_numpy(int)
    n, k = len(used), len(np.unique(labels))
    res: dict[str, Any] = {
        "fraction": frac,
        "group": FETCH_FIRST,
        "policies": used["policy"].tolist(),
        "excluded": [
            {"policy": r.policy, "why": r.why_out} for r in pts[~pts["used"]].itertuples()
        ],
        "n": n,
        "n_streams": n_streams,
        "min_points": p.mass_min_points,
        "cluster_gap": p.mass_cluster_gap,
        "clusters": [
            {
                "cluster": int(c),
                "n": len(g),
                "policies": g["policy"].tolist(),
                "mass_lo": float(g["mass_per_token_layer"].min()),
                "mass_hi": float(g["mass_per_token_layer"].max()),
            }
            for c, g in used.groupby("cluster")
        ],
        "n_boot": p.n_boot,
    }
    corr = correlation(used["mass_per_token_layer"], used["dppl_pct"], parametric=False)
    res.update(corr, n=n)
    if n < p.mass_min_points:
        res.update(r=None, rho=None)
        corr["reason"] = (
            f"not reported: {n} {'policy substitutes' if n == 1 else 'policies substitute'} "
            f"here, r needs at least {p.mass_min_points} (over fewer, one or two points decide it)"
        )
    res["reason"] = corr["reason"]
    within_reason = None
    if k == n:
        within_reason = "every point is its own cluster"
    elif n - k < 3:
        within_reason = f"{n - k} within-cluster degrees of freedom (needs 3)"
    rows = [i for i, name in enumerate(pts["policy"]) if name in set(used["policy"])]
    ivs = [Interval(None), Interval(None)]
    if res["reason"] is None:

        def stat(w: np.ndarray) -> np.ndarray:  # (R, S) -> (R, 2): r, within-cluster r
            mass, dppl = (a[:, rows] for a in mass_dppl(mats, w))
            return np.column_stack(
                [
                    rowwise_pearson(mass, dppl),
                    rowwise_pearson(within(mass, labels), within(dppl, labels)),
                ]
            )

        rng = rng_for(p.seed, "mass", frac)
        ivs = stream_bootstrap(stat, n_streams, p.n_boot, rng, p.ci_level, null=0.0)
    r_iv, w_iv = ivs
    res.update(r_iv.columns("r_"), p_value=r_iv.p_value, n_boot_valid=r_iv.n_valid)
    if within_reason is None and res["reason"] is not None:
        within_reason = "r is not reported"
    if within_reason is not None:
        w_iv = Interval(None)
    res.update(
        within_r=w_iv.estimate if within_reason is None else None, within_reason=within_reason
    )
    res.update(w_iv.columns("within_r_") if within_reason is None else {})
    for key in ("r_t_ci_lo", "r_t_ci_hi", "within_r_t_ci_lo", "within_r_t_ci_hi"):
        if res.get(key) is not None:
            res[key] = float(np.clip(res[key], -1.0, 1.0))
    common = {"fraction": frac, "n_units": n_streams, "min_p": 1.0 / p.n_boot}
    tests = [
        StatTest(
            kind="mass_hypothesis",
            name=f"r(mass, Δppl) over {n} fetch-first policies",
            hypothesis="policies that substitute more gate mass raise perplexity more",
            expected=1,
            estimand="Pearson r across policies (streams resampled)",
            **({**from_interval(r_iv), "t_ci_lo": res["r_t_ci_lo"], "t_ci_hi": res["r_t_ci_hi"]}),
            mde=normal_mde(r_iv.se, p.alpha, p.power),
            reason=res["reason"],
            **common,
        )
    ]
    if k > 1:
        tests.append(
            StatTest(
                kind="mass_within_clusters",
                name=f"within-cluster r(mass, Δppl), {k} clusters",
                hypothesis="inside each cluster of mass, more mass goes with more Δppl",
                expected=1,
                estimand="Pearson r of mass and Δppl each less its cluster's mean",
                **(
                    {
                        **from_interval(w_iv),
                        "t_ci_lo": res.get("within_r_t_ci_lo"),
                        "t_ci_hi": res.get("within_r_t_ci_hi"),
                    }
                ),
                mde=normal_mde(w_iv.se, p.alpha, p.power),
                reason=within_reason,
                **common,
            )
        )
    return res, tests


def substitute_all_entry(pts: pd.DataFrame) -> dict[str, Any] | None:
    """substitute_all against the used points (module doc); None when it did not run."""
    sub = pts[pts["group"] == SUBSTITUTE_FIRST]
    used = pts[pts["used"]]
    if sub.empty:
        return None
    s = sub.iloc[0]
    out: dict[str, Any] = {
        "policy": s["policy"],
        "mass": float(s["mass_per_token_layer"]),
        "dppl_pct": float(s["dppl_pct"]),
        "line_dppl_pct": None,
        "nearest": None,
    }
    if len(used) >= 2 and used["mass_per_token_layer"].nunique() > 1:
        slope, icpt = np.polyfit(used["mass_per_token_layer"], used["dppl_pct"], 1)
        out["line_dppl_pct"] = float(slope * out["mass"] + icpt)
    if len(used):
        near = used.iloc[(used["mass_per_token_layer"] - out["mass"]).abs().argmin()]
        out.update(
            nearest=near["policy"],
            nearest_mass=float(near["mass_per_token_layer"]),
            nearest_dppl_pct=float(near["dppl_pct"]),
        )
    return out
