"""Experiment B statistics: heavy vs light substitution at equal target mass, two designs.

Inputs: the per-token artefacts of `moesub.expb` (`.../expb/{design}/{condition}/m<mass>.parquet`)
and the captured exact NLL. Masses are per token-layer (mean over every token-layer, substituted
or not). Per design, target mass m* and stream s:

- `m_c(s)`: the realized mean mass of condition c; `ΔNLL_c(s)`: the mean over the stream's
  tokens of `nll_c - nll_exact`;
- the paired difference `d(s)`: design `study` (the reference study's statistic)
  `ΔNLL_heavy(s) / m_heavy(s) - ΔNLL_light(s) / m_light(s)` (streams with a realized mass of 0
  are dropped and counted); design `matched` `ΔNLL_heavy(s) - ΔNLL_light(s)` (the masses are
  matched by the design and checked by its validity condition, not divided out).

Pre-registered decision rules (config `expb.designs`), pooled realized masses m_h, m_l:

- `study` (the study's rule): valid iff `m_h >= min_heavy_fraction * m*` and
  `|m_h - m_l| <= max_gap * min(m_h, m_l)`;
- `matched`: valid iff `|m_h - m_l| <= max_gap * min(m_h, m_l)` (max_gap 0.05) and
  `min(m_h, m_l) >= min_realized_fraction * m*` (0.9);

then a one-sided Wilcoxon signed-rank test over streams of d > 0 at `alpha`: outcome
"heavy worse" (p < alpha), "heavy not worse", or "invalid (why)" when the validity condition
fails. The statement the report makes is two-sided (a light condition that hurts more is
evidence against the hypothesis, not "no evidence"): the Hodges-Lehmann estimate of d (median
of the Walsh averages) with its distribution-free interval at `ci_level` (order statistics of
the Walsh averages at the exact signed-rank critical value) and the two-sided Wilcoxon p that
this interval inverts (`p_two_sided`); beside them, as sensitivity figures, the mean of d with
its t interval and the minimum detectable mean difference of a two-sided test at alpha and
`power` (normal approximation, `moesub.stats.power.paired_mde`), n, the smallest reachable
two-sided p (`2^(1-n)`), the rank confound (mean rank
of the substituted experts per condition) and, for `matched`, the support (eligible share of the
evaluation token-layers, and `calib_support` / `max_target` from the calibration feasibility
table), the plan's share and the overlap of the substituted token-layers of the two conditions
(the "same token-layers" check: token-layers substituted in both / in either).

Entry point: `expb(tokens, runs, feasibility, p) -> ExpB`: the table (one row per design and
target mass), the per-stream table (one row per design, target mass and stream), the results
(one entry per design: its rule, the primary target's decision, every target) and the tests
(`moesub.stats.multiplicity`: each design's primary m* pre-registered, the other targets
exploratory). The decision
rules themselves (`ExpBRule`, `DesignRule`) are config: `moesub.stats.params`.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import polars as pl
from scipy import stats as sps

from moesub.stats.load import FileInfo, missing
from moesub.stats.multiplicity import StatTest
from moesub.stats.params import AnalysisParams, DesignRule
from moesub.stats.power import paired_mde, wilcoxon_min_p
from moesub.stats.tokens import Tokens

DESIGN_LABELS = {
    "study": "study design (the reference study's heavy/light rules)",
    "matched": "matched design (same token-layers, matched mass)",
}


# ---------------------------------------------------------------------------------- statistics
def signed_rank_cdf(n: int) -> np.ndarray:
    """P(T+ <= t) for t = 0..n(n+1)/2 under the null (exact, by counting sign patterns)."""
    counts = np.zeros(n * (n + 1) // 2 + 1)
    counts[0] = 1.0
    for i in range(1, n + 1):
        counts[i:] = counts[i:] + counts[:-i].copy()
    return np.cumsum(counts) / 2.0**n


def hodges_lehmann(d: np.ndarray, level: float) -> tuple[float | None, float | None, float | None]:
    """(estimate, lo, hi): the median of the Walsh averages of d and the distribution-free
    interval at `level` (None bounds when n is too small for that level)."""
    d = np.asarray(d, dtype=float)
    n = d.size
    if n == 0:
        return None, None, None
    i, j = np.triu_indices(n)
    walsh = np.sort((d[i] + d[j]) / 2.0)  # (n(n+1)/2,)
    est = float(np.median(walsh))
    c = int(np.searchsorted(signed_rank_cdf(n), (1 - level) / 2, side="right"))  # P(T+<c)<=a/2
    if c < 1:
        return est, None, None
    return est, float(walsh[c - 1]), float(walsh[walsh.size - c])


def decide(
    rule: DesignRule, target: float, m_h: float, m_l: float, d: np.ndarray, alpha: float
) -> dict[str, Any]:
    """The decision at one target mass from the pooled realized masses and the per-stream
    paired differences d (finite ones only): valid, outcome, p, statistic and the text."""
    gap = abs(m_h - m_l) / min(m_h, m_l) if min(m_h, m_l) > 0 else math.inf
    eps = 1e-12  # a boundary case computed in floating point is on the boundary
    why = []
    if min(m_h, m_l) <= 0:
        why.append("a condition realized no mass")
    elif gap > rule.max_gap + eps:
        why.append(f"realized masses differ by {100 * gap:.1f}% > {100 * rule.max_gap:g}%")
    if rule.min_heavy_fraction is not None and m_h < rule.min_heavy_fraction * target - eps:
        why.append(
            f"heavy realized {m_h:.4g} < {100 * rule.min_heavy_fraction:g}% of m* {target:g}"
        )
    if (
        rule.min_realized_fraction is not None
        and min(m_h, m_l) < rule.min_realized_fraction * target - eps
    ):
        why.append(
            f"realized {min(m_h, m_l):.4g} < {100 * rule.min_realized_fraction:g}% of m* {target:g}"
        )
    if d.size == 0:
        why.append("no stream has both conditions")
    masses = f"realized mass per token-layer heavy {m_h:.4g}, light {m_l:.4g} (m* {target:g})"
    out: dict[str, Any] = {
        "valid": not why,
        "relative_gap": gap,
        "p_value": None,
        "p_two_sided": None,
        "statistic": None,
    }
    if why:
        out.update(outcome="invalid", outcome_text=f"invalid ({'; '.join(why)}; {masses})")
        return out
    nonzero = int((d != 0).sum())
    if nonzero == 0:
        p, stat, p2 = 1.0, 0.0, 1.0
    else:
        test = sps.wilcoxon(d, alternative="greater")
        p, stat = float(test.pvalue), float(test.statistic)
        p2 = float(sps.wilcoxon(d, alternative="two-sided").pvalue)
    worse = p < alpha
    out.update(
        p_value=p,
        p_two_sided=p2,
        statistic=stat,
        outcome="heavy worse" if worse else "heavy not worse",
    )
    floor = wilcoxon_min_p(nonzero)
    note = (
        f"; p cannot go below {floor:.3g} with {nonzero} non-zero differences"
        if floor >= alpha
        else ""
    )
    out["outcome_text"] = (
        f"{out['outcome']} (one-sided Wilcoxon signed-rank p = {p:.3g} "
        f"{'<' if worse else '>='} alpha {alpha:g}, n = {d.size} streams; {masses}{note})"
    )
    return out


# ---------------------------------------------------------------------------------- loading
def _token_runs(
    tokens: Tokens, files: list[FileInfo]
) -> dict[tuple[str, float, str], tuple[pl.DataFrame, dict]]:
    """(design, target, condition) -> (the run's per-token rows with `dnll` = nll - the
    captured exact nll (`cap`), the file's metadata)."""
    cap = pl.from_pandas(tokens.db.execute("SELECT stream, pos, nll AS nll_exact FROM cap").df())
    cap = cap.with_columns(pl.col("stream").cast(pl.Int32), pl.col("pos").cast(pl.Int32))
    runs = {}
    for info in files:
        df = pl.read_parquet(info.path)
        for col in ("rank_sum", "n_planned"):  # artefacts written before these were recorded
            if col not in df.columns:
                df = df.with_columns(pl.lit(None, dtype=pl.Int32).alias(col))
        df = df.join(cap, on=["stream", "pos"], how="left").with_columns(
            dnll=pl.col("nll") - pl.col("nll_exact")
        )
        runs[(info.name or "study", float(info.target_mass), info.condition)] = (df, info.meta)
    return runs


def _feasibility(paths: list[str]) -> dict[str, Any]:
    """The calibration feasibility of the configured heavy_mass (`calib_support`, the reachable
    `max_target`), when the feasibility table is among the inputs."""
    for path in paths:
        row = pl.read_parquet(path).filter(pl.col("configured"))
        if row.height == 1:
            return {"calib_support": row["support"][0], "max_target": row["max_target"][0]}
    return {}


def _layer_mass(df: pl.DataFrame) -> np.ndarray:
    n = df.height
    flat = df["layer_mass"].explode().to_numpy().astype(float)
    return flat.reshape(n, flat.size // n)  # (N, L)


def _per_stream(df: pl.DataFrame) -> pd.DataFrame:
    lm = _layer_mass(df)
    agg = (
        df.with_columns(pl.Series("tl_mass", lm.sum(axis=1)), pl.lit(lm.shape[1]).alias("L"))
        .group_by("stream")
        .agg(
            mass=pl.col("tl_mass").sum() / pl.col("L").sum(),
            dnll=pl.col("dnll").mean(),
        )
        .sort("stream")
    )
    return agg.to_pandas().set_index("stream")


def _rank_mean(df: pl.DataFrame) -> float | None:
    n = df["n_sub"].sum()
    return None if not n or df["rank_sum"].null_count() else float(df["rank_sum"].sum() / n)


def target_result(
    design: str,
    target: float,
    runs: dict,
    rule: DesignRule,
    alpha: float,
    level: float,
    power: float,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One (design, target mass): the per-target row and the per-stream rows."""
    (h, meta_h), (light, _) = runs[(design, target, "heavy")], runs[(design, target, "light")]
    ps_h, ps_l = _per_stream(h), _per_stream(light)
    streams = ps_h.index.intersection(ps_l.index).sort_values()
    mh, ml = ps_h.loc[streams, "mass"], ps_l.loc[streams, "mass"]
    dh, dl = ps_h.loc[streams, "dnll"], ps_l.loc[streams, "dnll"]
    with np.errstate(invalid="ignore", divide="ignore"):
        d = dh / mh - dl / ml if design == "study" else dh - dl
    usable = np.isfinite(d.to_numpy(float))
    d_ok = d.to_numpy(float)[usable]
    lm_h, lm_l = _layer_mass(h), _layer_mass(light)
    m_h, m_l = float(lm_h.mean()), float(lm_l.mean())
    row: dict[str, Any] = {
        "design": design,
        "target_mass": target,
        "primary": bool(math.isclose(target, rule.primary, rel_tol=1e-9)),
        **decide(rule, target, m_h, m_l, d_ok, alpha),
        "n_streams": int(d_ok.size),
        "n_dropped_streams": int(len(streams) - d_ok.size),
        "realized_heavy": m_h,
        "realized_light": m_l,
        "substituted_share_heavy": float((lm_h > 0).mean()),
        "substituted_share_light": float((lm_l > 0).mean()),
        "mean_rank_heavy": _rank_mean(h),
        "mean_rank_light": _rank_mean(light),
        "effect_label": "ΔNLL/mass heavy − light" if design == "study" else "ΔNLL heavy − light",
        "alpha": alpha,
        "ci_level": level,
        "power": power,
        "min_p": wilcoxon_min_p(int((d_ok != 0).sum())),
        "mean_d": float(d_ok.mean()) if d_ok.size else None,
        "sd_d": float(d_ok.std(ddof=1)) if d_ok.size > 1 else None,
    }
    row["effect"], row["effect_ci_lo"], row["effect_ci_hi"] = hodges_lehmann(d_ok, level)
    row["min_p_two_sided"] = wilcoxon_min_p(int((d_ok != 0).sum()), "two-sided")
    row["mde"] = None
    if row["sd_d"]:
        n = int(d_ok.size)
        row["mde"] = paired_mde(row["sd_d"], n, alpha, power, "two-sided")
        half = float(sps.t.ppf(0.5 + level / 2, n - 1)) * row["sd_d"] / math.sqrt(n)
        row["mean_t_ci_lo"], row["mean_t_ci_hi"] = row["mean_d"] - half, row["mean_d"] + half
    if design == "matched":
        joined = (
            h.select("stream", "pos")
            .with_row_index("i")
            .join(light.select("stream", "pos").with_row_index("j"), on=["stream", "pos"])
        )
        sub_h = lm_h[joined["i"].to_numpy()] > 0
        sub_l = lm_l[joined["j"].to_numpy()] > 0
        either = int((sub_h | sub_l).sum())
        row["overlap"] = float((sub_h & sub_l).sum() / either) if either else None
        for c, df in (("heavy", h), ("light", light)):
            planned = df["n_planned"].sum()
            row[f"dropped_{c}"] = float(1 - df["n_sub"].sum() / planned) if planned else None
        row["support"] = meta_h.get("plan_support")
        row["plan_share"] = meta_h.get("plan_share")
        row["heavy_mass"] = meta_h.get("heavy_mass", rule.heavy_mass)
    stream_rows = [
        {
            "design": design,
            "target_mass": target,
            "stream": int(s),
            "mass_heavy": float(mh[s]),
            "mass_light": float(ml[s]),
            "dnll_heavy": float(dh[s]),
            "dnll_light": float(dl[s]),
            "d": float(d[s]),
            "usable": bool(u),
        }
        for s, u in zip(streams, usable, strict=True)
    ]
    return row, stream_rows


def expb_test(row: dict[str, Any]) -> StatTest:
    """The two-sided test of one (design, target mass) row (module doc)."""
    valid = bool(row.get("valid"))
    one_sided = f"pre-registered one-sided rule: {row.get('outcome_text')}"
    return StatTest(
        kind="expb_primary" if row.get("primary") else "expb_target",
        name=f"{row['design']} design, m* {row['target_mass']:g}",
        hypothesis="at equal mass, one heavy substitution hurts more than several light ones",
        expected=1,
        estimand=f"{row.get('effect_label', 'ΔNLL heavy − light')} (Hodges-Lehmann)",
        estimate=row.get("effect"),
        ci_lo=row.get("effect_ci_lo"),
        ci_hi=row.get("effect_ci_hi"),
        ci_method="Hodges-Lehmann, distribution-free (signed-rank order statistics)",
        t_ci_lo=row.get("mean_t_ci_lo"),
        t_ci_hi=row.get("mean_t_ci_hi"),
        p_value=row.get("p_two_sided") if valid else None,
        p_method="Wilcoxon signed-rank, two-sided",
        mde=row.get("mde"),
        min_p=row.get("min_p_two_sided"),
        n_units=row.get("n_streams"),
        sensitivity=one_sided if valid else None,
        reason=None if valid else str(row.get("outcome_text") or "invalid"),
    )


class ExpB(NamedTuple):
    """`table`: one row per (design, target mass); `streams`: one row per (design, target mass,
    stream); `results`: one entry per design (`analysis.json["expb"]`, None when the part is
    missing); `tests`; `status`."""

    table: pd.DataFrame
    streams: pd.DataFrame
    results: list[dict[str, Any]] | None
    tests: list[StatTest]
    status: dict[str, Any]


def expb(tokens: Tokens, runs: list[FileInfo], feasibility: list[str], p: AnalysisParams) -> ExpB:
    """Experiment B's decisions from its runs' files, the captured exact NLL (`cap`) and the
    calibration feasibility tables `feasibility` (paths, maybe none), by `p.expb`'s rules."""

    def not_run(why: str) -> ExpB:
        return ExpB(pd.DataFrame(), pd.DataFrame(), None, [], missing(why))

    if not runs:
        return not_run("no Experiment B artefacts")
    if not tokens.captured:
        return not_run("Experiment B needs the captured exact NLL (capture)")
    if p.expb is None:
        return not_run("no decision rule in params['expb']")
    rules = p.expb
    level, power = p.ci_level, p.power
    by_run = _token_runs(tokens, runs)
    feasible = _feasibility(feasibility)
    rows, stream_rows, results = [], [], []
    for design, rule in rules.designs.items():
        targets = sorted({t for (dz, t, _c) in by_run if dz == design})
        design_rows = []
        for target in targets:
            conds = {c for (dz, t, c) in by_run if dz == design and t == target}
            if conds != {"heavy", "light"}:
                design_rows.append(
                    {"design": design, "target_mass": target, "valid": False,
                     "primary": math.isclose(target, rule.primary, rel_tol=1e-9),
                     "outcome": "invalid", "outcome_text": f"invalid (only {sorted(conds)} ran)"}
                )  # fmt: skip
                continue
            row, srows = target_result(design, target, by_run, rule, rules.alpha, level, power)
            if design == "matched":
                row.update(feasible)
            design_rows.append(row)
            stream_rows.extend(srows)
        primary = [r for r in design_rows if r.get("primary")]
        decision = dict(primary[0]) if primary else {
            "design": design,
            "target_mass": rule.primary,
            "valid": False,
            "outcome": "invalid",
            "outcome_text": f"invalid (no heavy and light runs at m* = {rule.primary:g}; "
            f"targets run: {targets})",
        }  # fmt: skip
        results.append(
            {
                "design": design,
                "label": DESIGN_LABELS[design],
                "rule": {**asdict(rule), "alpha": rules.alpha},
                "decision": decision,
                "targets": design_rows,
            }
        )
        rows.extend(design_rows)
    tests = [expb_test(r) for r in rows]
    return ExpB(pd.DataFrame(rows), pd.DataFrame(stream_rows), results, tests, {"status": "ok"})
