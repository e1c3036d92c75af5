"""Experiment B statistics: heavy vs light substitution at a matched target mass.

Per stream s and condition c, `ΔNLL_c(s)` = mean over the stream's tokens of `nll_c - nll_exact`
(captured) and `m_c(s)` its realized mean mass; the paired statistic is
`d(s) = ΔNLL_heavy(s) / m_heavy(s) - ΔNLL_light(s) / m_light(s)` (streams where a realized mass
is 0 are dropped and counted). "Within 10% of each other" means
`|m_heavy - m_light| <= max_gap * min(m_heavy, m_light)` (each within 10% of the other).

Entry point: `expb_part(ctx)` fills `ctx.tables["expb"]`, `ctx.results["expb"]`,
`ctx.parts["expb"]`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from moesub.stats.load import Context, missing, number, sql_list


@dataclass(frozen=True)
class ExpBRule:
    """Experiment B's pre-registered decision rule (config `expb:`)."""

    primary: float  # m*: the primary target mass
    alpha: float = 0.05
    min_heavy_fraction: float = 0.5  # heavy realized mean mass must be >= this * m*
    max_gap: float = 0.10  # |m_heavy - m_light| <= max_gap * min(m_heavy, m_light)

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> ExpBRule:
        if not isinstance(spec, Mapping):
            raise ValueError(f"params['expb'] must be a mapping, got {type(spec).__name__}")
        if "primary" not in spec:
            raise ValueError("params['expb']['primary'] (the primary target mass m*) is required")
        rule = cls(
            primary=number(spec["primary"], "params['expb']['primary']"),
            alpha=number(spec.get("alpha", 0.05), "params['expb']['alpha']"),
            min_heavy_fraction=number(
                spec.get("min_heavy_fraction", 0.5), "params['expb']['min_heavy_fraction']"
            ),
            max_gap=number(spec.get("max_gap", 0.10), "params['expb']['max_gap']"),
        )
        if rule.primary <= 0:
            raise ValueError(f"params['expb']['primary']={rule.primary} must be > 0")
        if not 0 < rule.alpha < 1:
            raise ValueError(f"params['expb']['alpha']={rule.alpha} must be in (0, 1)")
        if not 0 <= rule.min_heavy_fraction <= 1 or rule.max_gap < 0:
            raise ValueError("params['expb']: min_heavy_fraction must be in [0, 1], max_gap >= 0")
        return rule


def expb_part(ctx: Context) -> None:
    ctx.tables["expb"] = pd.DataFrame()
    ctx.results["expb"] = None
    if not ctx.inputs["expb"]:
        ctx.parts["expb"] = missing("no Experiment B artefacts")
        return
    if not ctx.inputs["capture_tokens"]:
        ctx.parts["expb"] = missing("Experiment B needs the captured exact NLL (capture)")
        return
    if ctx.p.expb is None:
        ctx.parts["expb"] = missing("no decision rule in params['expb']")
        return
    files = ctx.register_files("expb")
    per = ctx.con.execute(
        f"""
        SELECT f.condition, f.target_mass, t.stream,
               -- m* is a mass per token-layer: count token-layers, not tokens
               sum(len(t.layer_mass)) AS n_tok, sum(t.mass) AS sum_mass,
               sum(t.n_sub) AS n_sub,
               count(t.nll - c.nll) AS n_nll, coalesce(sum(t.nll - c.nll), 0) AS sum_dnll
        FROM read_parquet({sql_list(ctx.inputs["expb"])}, filename=true) t
        JOIN {files} f USING (filename)
        LEFT JOIN cap c ON t.stream = c.stream AND t.pos = c.pos
        GROUP BY ALL ORDER BY f.target_mass, t.stream, f.condition
        """
    ).df()
    rule = ctx.p.expb
    stream_rows, targets = [], []
    for target, g in per.groupby("target_mass", sort=True):
        res, rows = expb_test(g, float(target), rule)
        res["primary"] = bool(math.isclose(target, rule.primary, rel_tol=1e-9))
        targets.append(res)
        stream_rows.extend(rows)
    primary = [t for t in targets if t["primary"]]
    if primary:
        decision = dict(primary[0])
    else:
        decision = {
            "target_mass": rule.primary,
            "outcome": "inconclusive",
            "outcome_text": f"inconclusive (no heavy and light runs at m* = {rule.primary:g}; "
            f"targets run: {[t['target_mass'] for t in targets]})",
        }
    decision["rule"] = asdict(rule)
    ctx.results["expb"] = {"decision": decision, "targets": targets}
    ctx.tables["expb"] = pd.DataFrame(stream_rows)
    ctx.parts["expb"] = {"status": "ok"}


def expb_test(per: pd.DataFrame, target: float, rule: ExpBRule) -> tuple[dict, list[dict]]:
    """Experiment B at one target mass.

    `per`: one row per (condition, stream) with n_tok, sum_mass, n_nll, sum_dnll (ΔNLL vs the
    captured exact NLL). Returns the decision dict and the per-stream rows.
    """
    res: dict[str, Any] = {"target_mass": target, "alpha": rule.alpha}
    conds = {c: g.set_index("stream") for c, g in per.groupby("condition")}
    if set(conds) != {"heavy", "light"}:
        res.update(
            outcome="inconclusive",
            outcome_text=f"inconclusive (only {sorted(conds)} ran at m = {target:g})",
        )
        return res, []
    h, light = conds["heavy"], conds["light"]
    m_h = float(h["sum_mass"].sum() / h["n_tok"].sum())
    m_l = float(light["sum_mass"].sum() / light["n_tok"].sum())
    gap = abs(m_h - m_l) / min(m_h, m_l) if min(m_h, m_l) > 0 else math.inf
    res.update(
        realized_heavy=m_h,
        realized_light=m_l,
        heavy_fraction_of_target=m_h / target,
        relative_gap=gap,
    )
    streams = h.index.intersection(light.index).sort_values()
    hs, ls = h.loc[streams], light.loc[streams]
    with np.errstate(invalid="ignore", divide="ignore"):
        mh, ml = hs["sum_mass"] / hs["n_tok"], ls["sum_mass"] / ls["n_tok"]
        dh, dl = hs["sum_dnll"] / hs["n_nll"], ls["sum_dnll"] / ls["n_nll"]
        d = dh / mh - dl / ml
    usable = np.isfinite(d.to_numpy(float))
    rows = [
        {
            "target_mass": target,
            "stream": int(s),
            "mass_heavy": float(mh[s]),
            "mass_light": float(ml[s]),
            "dnll_heavy": float(dh[s]),
            "dnll_light": float(dl[s]),
            "d_per_mass": float(d[s]),
            "usable": bool(u),
        }
        for s, u in zip(streams, usable, strict=True)
    ]
    d_ok = d.to_numpy(float)[usable]
    res.update(
        n_streams=len(streams),
        n_used=int(d_ok.size),
        n_dropped=int(len(streams) - d_ok.size),
        median_d=float(np.median(d_ok)) if d_ok.size else None,
        mean_d=float(d_ok.mean()) if d_ok.size else None,
    )
    valid_mass = m_h >= rule.min_heavy_fraction * target
    valid_gap = gap <= rule.max_gap
    res["valid"] = bool(valid_mass and valid_gap)
    masses = (
        f"heavy {m_h:.4g} = {100 * m_h / target:.0f}% of m* {target:g} "
        f"(needs >= {100 * rule.min_heavy_fraction:.0f}%), light {m_l:.4g}, "
        f"gap {100 * gap:.1f}% (needs <= {100 * rule.max_gap:.0f}%)"
    )
    if not res["valid"]:
        res.update(
            outcome="inconclusive", p=None, outcome_text=f"inconclusive (realized mass {masses})"
        )
        return res, rows
    nonzero = int((d_ok != 0).sum())
    res["min_attainable_p"] = 0.5**nonzero if nonzero else 1.0
    if nonzero == 0:
        p, stat = 1.0, 0.0
    else:
        test = sps.wilcoxon(d_ok, alternative="greater")
        p, stat = float(test.pvalue), float(test.statistic)
    res.update(p=p, statistic=stat)
    worse = p < rule.alpha
    detail = (
        f"Wilcoxon signed-rank one-sided p = {p:.3g} {'<' if worse else '>='} alpha "
        f"{rule.alpha:g}, n = {d_ok.size} streams, median ΔNLL difference per unit mass "
        f"{res['median_d']:.4g}; realized mass {masses}"
    )
    if worse:
        res.update(outcome="heavy worse", outcome_text=f"heavy worse ({detail})")
    else:
        note = (
            f"; with {nonzero} non-zero differences p cannot go below {res['min_attainable_p']:.3g}"
            if res["min_attainable_p"] >= rule.alpha
            else ""
        )
        res.update(outcome="no evidence", outcome_text=f"no evidence ({detail}{note})")
    return res, rows
