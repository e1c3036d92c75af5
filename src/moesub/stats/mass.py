"""The mass hypothesis (Δppl grows with substituted mass across policies) and its per-input form.

Groups: "fetches first choice" = rules `threshold` and `first_choice` (any eviction, any beta):
they may substitute, never the router's first choice. `fetch_all` and `host_compute` are
excluded: they never substitute, so their mass and Δppl are 0 by construction and would add
identical (0, 0) points that inflate r without information. "substitutes first choice" = rule
`substitute_all`, shown separately (r is undefined, with the reason, when n < 3 or a coordinate
is constant). Computed per cache fraction; the CI resamples streams (the same resample for
every policy), recomputes each policy's mass and Δppl, then r.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from moesub.stats.intervals import boot_counts, correlation, percentile_ci, rng_for, rowwise_pearson
from moesub.stats.load import Context, missing
from moesub.stats.quality import dppl_pct

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
        w = boot_counts(len(streams), ctx.p.n_boot, rng_for(ctx.p.seed, "mass", frac))
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
            with np.errstate(invalid="ignore", divide="ignore"):
                mass = mats["sum_mass"].sum(1) / mats["n_tok"].sum(1)
                dppl = dppl_pct(mats["sum_dnll"].sum(1) / mats["n_nll"].sum(1))
                mass_b = (w @ mats["sum_mass"].T) / (w @ mats["n_tok"].T)  # (B, P)
                dppl_b = dppl_pct((w @ mats["sum_dnll"].T) / (w @ mats["n_nll"].T))
            corr = correlation(mass, dppl)
            res = {"fraction": float(frac), "group": group, "policies": names, **corr}
            res["n_boot"] = ctx.p.n_boot
            res["ci_lo"] = res["ci_hi"] = None
            res["n_boot_valid"] = 0
            if corr["r"] is not None:
                r_b = rowwise_pearson(mass_b, dppl_b)
                res["n_boot_valid"] = int(np.isfinite(r_b).sum())
                res["ci_lo"], res["ci_hi"] = percentile_ci(r_b, ctx.p.ci_level)
            results.append(res)
            for name, m, d in zip(names, mass, dppl, strict=True):
                points.append(
                    {
                        "fraction": float(frac),
                        "group": group,
                        "policy": name,
                        "mass_mean": float(m),
                        "dppl_pct": float(d),
                    }
                )
    ctx.tables["mass_points"] = pd.DataFrame(points)
    ctx.results["mass_hypothesis"] = results
    ctx.parts["mass_hypothesis"] = {"status": "ok"}


def per_input_part(ctx: Context) -> None:
    ps = ctx.tables["emu_streams"]
    if ps.empty or not (ps["n_nll"] > 0).any():
        ctx.parts["per_input"] = missing("needs emulate artefacts and a baseline NLL")
        ctx.tables["per_input"] = ctx.tables["per_input_points"] = pd.DataFrame()
        return
    docs = ctx.con.execute(
        """
        SELECT e.name, e.fraction, e.doc_id AS unit,
               avg(e.mass) AS mass_mean, avg(e.nll - b.nll_b) AS dnll_mean,
               count(e.nll - b.nll_b) AS n_nll
        FROM emu e JOIN emu_base b
          ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
        GROUP BY ALL
        """
    ).df()
    docs["level"] = "document"
    streams = ps.assign(
        unit=ps["stream"],
        mass_mean=ps["sum_mass"] / ps["n_tok"],
        dnll_mean=ps["sum_dnll"] / ps["n_nll"].where(ps["n_nll"] > 0),
        level="stream",
    )[["name", "fraction", "unit", "mass_mean", "dnll_mean", "n_nll", "level"]]
    pts = pd.concat([streams, docs[streams.columns]], ignore_index=True)
    pts = pts[pts["n_nll"] > 0].rename(columns={"name": "policy"})
    pts = pts.sort_values(["policy", "fraction", "level", "unit"], ignore_index=True)
    rows = []
    for (name, frac, level), g in pts.groupby(["policy", "fraction", "level"], sort=True):
        if name == ctx.p.baseline:
            continue
        corr = correlation(g["mass_mean"], g["dnll_mean"])
        rows.append({"policy": name, "fraction": float(frac), "level": level, **corr})
    ctx.tables["per_input_points"] = pts
    ctx.tables["per_input"] = pd.DataFrame(rows)
    ctx.parts["per_input"] = {"status": "ok"}
