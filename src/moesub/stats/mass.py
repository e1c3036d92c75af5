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

Per input (`per_input_part`): within one policy, r between per-stream (or per-document) mean
mass and mean ΔNLL; streams are independent units, so Pearson's p and the Fisher-z CI at
`ci_level` stand there.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moesub.metrics import dppl_pct
from moesub.stats.intervals import correlation, rng_for, rowwise_pearson, stream_bootstrap
from moesub.stats.load import Context, missing

FETCH_FIRST_RULES = ("threshold", "first_choice")
SUBSTITUTE_FIRST_RULES = ("substitute_all",)
NEVER_SUBSTITUTE_RULES = ("fetch_all", "host_compute")


def mass_hypothesis_part(ctx: Context) -> None:
    ps = ctx.tables["emu_streams"]
    if ps.empty or not (ps["n_nll"] > 0).any():
        ctx.parts["mass_hypothesis"] = missing(
            "needs emulate artefacts and a baseline NLL (fetch_every_miss or capture)"
        )
        ctx.tables["mass_points"] = pd.DataFrame()
        ctx.results["mass_hypothesis"] = []
        return
    groups = {
        "fetches first choice": FETCH_FIRST_RULES,
        "substitutes first choice": SUBSTITUTE_FIRST_RULES,
    }
    info_by_name = {i.name: i for i in ctx.infos["emulate"]}
    points, results = [], []
    for frac, gf in ps.groupby("fraction", sort=True):
        streams = np.sort(gf["stream"].unique())
        for group, rules in groups.items():
            names = []
            for name in sorted(gf["name"].unique()):
                pol = ctx.policy(name, info_by_name.get(name))
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
            res, pts = mass_correlation(mats, names, len(streams), float(frac), group, ctx)
            results.append(res)
            points.extend(pts)
    ctx.tables["mass_points"] = pd.DataFrame(points)
    ctx.results["mass_hypothesis"] = results
    ctx.parts["mass_hypothesis"] = {"status": "ok"}


def mass_correlation(
    mats: dict[str, np.ndarray],
    names: list[str],
    n_streams: int,
    frac: float,
    group: str,
    ctx: Context,
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
    res.update(r_ci_lo=None, r_ci_hi=None, r_bias=None, r_ci_method="none", n_boot=ctx.p.n_boot)
    res["n_boot_valid"] = 0
    if corr["r"] is not None:
        (iv,) = stream_bootstrap(
            lambda w: rowwise_pearson(*mass_dppl(w)),
            n_streams,
            ctx.p.n_boot,
            rng_for(ctx.p.seed, "mass", frac),
            ctx.p.ci_level,
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


def per_input_part(ctx: Context) -> None:
    ps = ctx.tables["emu_streams"]
    if ps.empty or not (ps["n_nll"] > 0).any():
        ctx.parts["per_input"] = missing("needs emulate artefacts and a baseline NLL")
        ctx.tables["per_input"] = ctx.tables["per_input_points"] = pd.DataFrame()
        return
    docs = ctx.con.execute(
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
    streams = ps.assign(
        unit=ps["stream"],
        mass_per_token_layer=ps["sum_mass"] / ps["n_tok"],
        dnll_mean=ps["sum_dnll"] / ps["n_nll"].where(ps["n_nll"] > 0),
        level="stream",
    )[["name", "fraction", "unit", "mass_per_token_layer", "dnll_mean", "n_nll", "level"]]
    pts = pd.concat([streams, docs[streams.columns]], ignore_index=True)
    pts = pts[pts["n_nll"] > 0].rename(columns={"name": "policy"})
    pts = pts.sort_values(["policy", "fraction", "level", "unit"], ignore_index=True)
    rows = []
    for (name, frac, level), g in pts.groupby(["policy", "fraction", "level"], sort=True):
        if name == ctx.p.baseline:
            continue
        corr = correlation(g["mass_per_token_layer"], g["dnll_mean"], ctx.p.ci_level)
        rows.append({"policy": name, "fraction": float(frac), "level": level, **corr})
    ctx.tables["per_input_points"] = pts
    ctx.tables["per_input"] = pd.DataFrame(rows)
    ctx.parts["per_input"] = {"status": "ok"}
