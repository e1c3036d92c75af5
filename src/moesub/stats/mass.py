"""The mass hypothesis (Δppl grows with substituted mass across policies) and its per-input form.

Groups: "fetches first choice" = rules `threshold` and `first_choice` (any eviction, any beta):
they may substitute, never the router's first choice. `fetch_all` and `host_compute` are
excluded: they never substitute, so their mass and Δppl are 0 by construction and would add
identical (0, 0) points that inflate r without information. "substitutes first choice" = rule
`substitute_all`, shown separately (r is undefined, with the reason, when n < 3 or a coordinate
is constant). Computed per cache fraction; mass is per token-layer. The CI resamples streams
(the same resample for every policy), recomputes each policy's mass and Δppl, then r; it is
BCa (basic where BCa is undefined) with the bootstrap bias beside r. No parametric p-value or
Fisher-z interval: the policies are nested sweeps of one another (tau, beta), not independent
samples, so only the stream resampling speaks to r's uncertainty.

Per input (`per_input`): within one policy, r between per-stream (or per-document) mean
mass and mean ΔNLL; streams are independent units, so Pearson's p and the Fisher-z CI at
`ci_level` stand there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from moesub.metrics import dppl_pct
from moesub.stats.intervals import correlation, rng_for, rowwise_pearson, stream_bootstrap
from moesub.stats.load import FileInfo, missing
from moesub.stats.params import AnalysisParams
from moesub.stats.tokens import Tokens

FETCH_FIRST_RULES = ("threshold", "first_choice")
SUBSTITUTE_FIRST_RULES = ("substitute_all",)
NEVER_SUBSTITUTE_RULES = ("fetch_all", "host_compute")


class MassHypothesis(NamedTuple):
    """`points`: per (fraction, group, policy) the mass and Δppl behind r; `results`: per
    (fraction, group) r with its interval (`analysis.json["mass_hypothesis"]`); `status`."""

    points: pd.DataFrame
    results: list[dict[str, Any]]
    status: dict[str, Any]


class PerInput(NamedTuple):
    """`table`: per (policy, fraction, level) r between per-unit mass and ΔNLL; `points`: per
    (policy, fraction, level, unit) the mean mass and ΔNLL; `status`."""

    table: pd.DataFrame
    points: pd.DataFrame
    status: dict[str, Any]


def mass_hypothesis(
    per_stream: pd.DataFrame, emulate: list[FileInfo], p: AnalysisParams
) -> MassHypothesis:
    """r(mass, Δppl) across policies per fraction and group, from the per-stream sums
    `per_stream` (`Quality.streams`); `emulate`: the runs' files (their metadata names a policy
    the config does not)."""
    if per_stream.empty or not (per_stream["n_nll"] > 0).any():
        why = "needs emulate artefacts and a baseline NLL (fetch_every_miss or capture)"
        return MassHypothesis(pd.DataFrame(), [], missing(why))
    groups = {
        "fetches first choice": FETCH_FIRST_RULES,
        "substitutes first choice": SUBSTITUTE_FIRST_RULES,
    }
    meta_by_name = {i.name: i.meta for i in emulate}
    points, results = [], []
    for frac, gf in per_stream.groupby("fraction", sort=True):
        streams = np.sort(gf["stream"].unique())
        for group, rules in groups.items():
            names = []
            for name in sorted(gf["name"].unique()):
                pol = p.policy(name, meta_by_name.get(name))
                if pol is not None and pol["rule"] in rules:
                    names.append(name)
            if not names:
                continue  # no policy of this kind ran at this fraction
            # (P, S) per-stream sums; streams a policy lacks contribute nothing to it
            mats = {
                c: gf.pivot_table(index="name", columns="stream", values=c, aggfunc="sum")
                .reindex(index=names, columns=streams)
                .fillna(0.0)
                .to_numpy(float)
                for c in ("n_tok", "sum_mass", "n_nll", "sum_dnll")
            }
            res, pts = mass_correlation(mats, names, len(streams), float(frac), group, p)
            results.append(res)
            points.extend(pts)
    return MassHypothesis(pd.DataFrame(points), results, {"status": "ok"})


def mass_correlation(
    mats: dict[str, np.ndarray],
    names: list[str],
    n_streams: int,
    frac: float,
    group: str,
    p: AnalysisParams,
) -> tuple[dict, list[dict]]:
    """r(mass, Δppl) across the policies `names` of one group, from their (P, S) per-stream
    sums `mats` (n_tok, sum_mass, n_nll, sum_dnll); returns the result and the points."""

    def mass_dppl(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # (R, S) -> 2 x (R, P)
        with np.errstate(invalid="ignore", divide="ignore"):
            mass = (w @ mats["sum_mass"].T) / (w @ mats["n_tok"].T)
            dppl = dppl_pct((w @ mats["sum_dnll"].T) / (w @ mats["n_nll"].T))
        return mass, dppl

    mass, dppl = (a[0] for a in mass_dppl(np.ones((1, n_streams))))
    corr = correlation(mass, dppl, parametric=False)
    res = {"fraction": frac, "group": group, "policies": names, **corr, "n_streams": n_streams}
    res.update(r_ci_lo=None, r_ci_hi=None, r_bias=None, r_ci_method="none", n_boot=p.n_boot)
    res["n_boot_valid"] = 0
    if corr["r"] is not None:
        (iv,) = stream_bootstrap(
            lambda w: rowwise_pearson(*mass_dppl(w)),
            n_streams,
            p.n_boot,
            rng_for(p.seed, "mass", frac),
            p.ci_level,
        )
        res.update(iv.columns("r_"), n_boot_valid=iv.n_valid)
    points = [
        {
            "fraction": frac,
            "group": group,
            "policy": name,
            "mass_per_token_layer": float(m),
            "dppl_pct": float(d),
        }
        for name, m, d in zip(names, mass, dppl, strict=True)
    ]
    return res, points


def per_input(per_stream: pd.DataFrame, tokens: Tokens, p: AnalysisParams) -> PerInput:
    """Within each policy, r between per-stream (from `per_stream`, `Quality.streams`) or
    per-document (from `emu`, `emu_base`) mean mass and mean ΔNLL."""
    if per_stream.empty or not (per_stream["n_nll"] > 0).any():
        why = "needs emulate artefacts and a baseline NLL"
        return PerInput(pd.DataFrame(), pd.DataFrame(), missing(why))
    docs = tokens.db.execute(
        """
        SELECT e.name, e.fraction, e.doc_id AS unit,
               avg(e.mass) AS mass_per_token_layer, avg(e.nll - b.nll_b) AS dnll_mean,
               count(e.nll - b.nll_b) AS n_nll
        FROM emu e JOIN emu_base b
          ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
        GROUP BY ALL
        """
    ).df()
    docs["level"] = "document"
    streams = per_stream.assign(
        unit=per_stream["stream"],
        mass_per_token_layer=per_stream["sum_mass"] / per_stream["n_tok"],
        dnll_mean=per_stream["sum_dnll"] / per_stream["n_nll"].where(per_stream["n_nll"] > 0),
        level="stream",
    )[["name", "fraction", "unit", "mass_per_token_layer", "dnll_mean", "n_nll", "level"]]
    pts = pd.concat([streams, docs[streams.columns]], ignore_index=True)
    pts = pts[pts["n_nll"] > 0].rename(columns={"name": "policy"})
    pts = pts.sort_values(["policy", "fraction", "level", "unit"], ignore_index=True)
    rows = []
    for (name, frac, level), g in pts.groupby(["policy", "fraction", "level"], sort=True):
        if name == p.baseline:
            continue
        corr = correlation(g["mass_per_token_layer"], g["dnll_mean"], p.ci_level)
        rows.append({"policy": name, "fraction": float(frac), "level": level, **corr})
    return PerInput(pd.DataFrame(rows), pts, {"status": "ok"})
