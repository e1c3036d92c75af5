"""Δppl and speedup: the one place in the project where they are computed.

Δppl % of a policy is `100 * (exp(mean(nll_p - nll_base)) - 1)` over the tokens both have an
NLL for; the base is `fetch_every_miss` (params `baseline`) emulated at the same cache fraction,
or, if that run is absent, the captured exact NLL (identical by construction). A speedup is a
ratio of times per token on the same device and fraction: `time(reference) / time(policy)`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from moesub.stats.intervals import boot_counts, percentile_ci, rng_for
from moesub.stats.load import COUNT_COLS, Context, missing


def dppl_pct(mean_dnll: np.ndarray | float) -> np.ndarray | float:
    """Δppl % from the mean per-token ΔNLL: 100 * (exp(mean ΔNLL) - 1)."""
    return 100.0 * np.expm1(mean_dnll)


def quality_part(ctx: Context) -> None:
    """Per-stream aggregates of emulate vs the baseline, and per-policy totals with CIs."""
    if not ctx.inputs["emulate"]:
        ctx.parts["quality"] = missing("no emulate artefacts")
        ctx.tables["emu_streams"] = pd.DataFrame()
        ctx.tables["quality"] = pd.DataFrame()
        return
    ps = ctx.con.execute(
        """
        SELECT e.name, e.fraction, e.stream,
               count(*) AS n_tok, sum(e.mass) AS sum_mass,
               count(e.nll - b.nll_b) AS n_nll,
               coalesce(sum(e.nll - b.nll_b), 0) AS sum_dnll,
               coalesce(sum(CASE WHEN b.nll_b IS NOT NULL THEN e.nll END), 0) AS sum_nll,
               coalesce(sum(CASE WHEN e.nll IS NOT NULL THEN b.nll_b END), 0) AS sum_nll_b,
               count(e.nll) AS n_nll_own, coalesce(sum(e.nll), 0) AS sum_nll_own,
               sum(e.hit) AS hit, sum(e."fetch") AS "fetch", sum(e.sub) AS sub,
               sum(e.host) AS host, sum(e.forced) AS forced
        FROM emu e LEFT JOIN emu_base b
          ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
        GROUP BY ALL ORDER BY e.name, e.fraction, e.stream
        """
    ).df()
    ctx.tables["emu_streams"] = ps
    rows = []
    for (name, frac), g in ps.groupby(["name", "fraction"], sort=True):
        streams = g["stream"].to_numpy()
        w = boot_counts(len(streams), ctx.p.n_boot, rng_for(ctx.p.seed, "quality", name, frac))
        n_tok, n_nll = g["n_tok"].to_numpy(float), g["n_nll"].to_numpy(float)
        sum_mass, sum_dnll = g["sum_mass"].to_numpy(float), g["sum_dnll"].to_numpy(float)
        calls = float(sum(g[c].sum() for c in COUNT_COLS))
        with np.errstate(invalid="ignore", divide="ignore"):
            mass_b = (w @ sum_mass) / (w @ n_tok)
            dppl_b = dppl_pct((w @ sum_dnll) / (w @ n_nll))
        has_base = n_nll.sum() > 0
        nll_n = n_nll.sum() if has_base else g["n_nll_own"].sum()
        nll_sum = g["sum_nll"].sum() if has_base else g["sum_nll_own"].sum()
        row = {
            "policy": name,
            "fraction": float(frac),
            "n_streams": len(streams),
            "n_tokens": int(n_tok.sum()),
            "n_nll_tokens": int(nll_n),
            "ppl": math.exp(nll_sum / nll_n) if nll_n else None,
            "ppl_base": math.exp(g["sum_nll_b"].sum() / nll_n) if has_base else None,
            "dppl_pct": float(dppl_pct(sum_dnll.sum() / n_nll.sum())) if has_base else None,
            "mass_mean": float(sum_mass.sum() / n_tok.sum()),
            "sub_rate": float(g["sub"].sum() / calls) if calls else None,
            "hit_rate": float(g["hit"].sum() / calls) if calls else None,
            "forced_rate": float(g["forced"].sum() / calls) if calls else None,
        }
        row["dppl_ci_lo"], row["dppl_ci_hi"] = (
            percentile_ci(dppl_b, ctx.p.ci_level) if has_base else (None, None)
        )
        row["mass_ci_lo"], row["mass_ci_hi"] = percentile_ci(mass_b, ctx.p.ci_level)
        rows.append(row)
    ctx.tables["quality"] = pd.DataFrame(rows)
    no_base = [f for f, s in ctx.results["dppl_base"].items() if s == "none"]
    ctx.parts["quality"] = (
        {"status": "ok"}
        if not no_base
        else {
            "status": "partial",
            "reason": f"no {ctx.p.baseline} run and no capture tokens at fraction(s) "
            f"{no_base}: Δppl undefined there",
        }
    )
