"""The degeneration section (`moesub.stats.degeneration`): per policy, how its free
continuations repeat and loop, beside its Δppl, each with an interval over prompts and a raw
paired p against the baseline; the figure (loop share and repeated 4-grams against Δppl); and
the sentences that say whether a policy makes text loop where perplexity barely moves.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from moesub.report.load import AnalysisOutputs, ci_label, finite  # noqa: E402
from moesub.report.plotting import FigureData, finish, panels  # noqa: E402
from moesub.report.tables import Col, Row, Table, interval, make_table, num, text  # noqa: E402

# measure -> (label, cell format of a value, of a difference; shares differ in points)
MEASURES = {
    "ends_in_loop": ("ends in a loop", "{:.0%}", "{:+.0f} pt"),
    "rep4": ("repeated 4-grams", "{:.1%}", "{:+.1f} pt"),
    "longest_repeat": ("longest repeated span, tokens", "{:.1f}", "{:+.1f}"),
}
SHARES = ("ends_in_loop", "rep4")
KEYS = ["model", "task", "policy", "fraction"]


def per_policy(df: pd.DataFrame) -> list[dict]:
    """One record per (model, task, policy, fraction): its Δppl and, per measure m, the stats
    row's columns prefixed `m.` (rows ordered by Δppl, the baseline first)."""
    keys = [k for k in KEYS if k in df.columns]
    out = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        first = g.iloc[0]
        rec = dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))
        rec |= {k: first.get(k) for k in ("dppl_pct", "dppl_ci_lo", "dppl_ci_hi")}
        for r in g.to_dict("records"):
            rec |= {f"{r['measure']}.{k}": v for k, v in r.items() if k not in keys}
        out.append(rec)
    return sorted(
        out,
        key=lambda r: (
            str(r.get("model", "")),
            str(r.get("task")),
            r.get("fraction") or 0,
            finite(r.get("dppl_pct")) and float(r["dppl_pct"]) != 0,
            float(r["dppl_pct"]) if finite(r.get("dppl_pct")) else np.inf,
            str(r["policy"]),
        ),
    )


def dppl_text(r: Row) -> str:
    if not finite(r.get("dppl_pct")):
        return "not emulated"
    iv = interval(r.get("dppl_ci_lo"), r.get("dppl_ci_hi"), "{:+.2f}")
    return f"{float(r['dppl_pct']):+.2f}" + (f" {iv}" if iv != "—" else "")


def versus(r: Row, m: str) -> str:
    """The paired difference against the baseline, its test and raw p."""
    diff = r.get(f"{m}.diff")
    if not finite(diff):
        return "—"
    value = float(diff) * (100 if m in SHARES else 1)
    return f"{MEASURES[m][2].format(value)} ({r.get(f'{m}.test')} p {num(r.get(f'{m}.p_raw'))})"


def degeneration_table(out: AnalysisOutputs) -> Table:
    """Per policy: Δppl %, then each measure's mean with its interval and the paired
    difference against the baseline (test, raw p)."""
    df = out.table("degeneration")
    if df.empty:
        return make_table("degeneration-table", [], [])
    ci = ci_label(out.ci_level)
    cols = [Col("model", text("model"), False)] if df["model"].nunique() > 1 else []
    cols += [Col("task", text("task"), False)] if df["task"].nunique() > 1 else []
    cols += [
        Col("policy", text("policy"), False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("prompts", lambda r: str(int(r.get("rep4.n") or 0))),
        Col(f"Δppl % {ci}", dppl_text),
    ]
    for m, (label, fmt, _) in MEASURES.items():
        cols += [
            Col(label, lambda r, m=m, fmt=fmt: num(r.get(f"{m}.mean"), fmt)),
            Col(
                f"{ci} ({'Wilson' if m == 'ends_in_loop' else 'bootstrap'})",
                lambda r, m=m, fmt=fmt: interval(r.get(f"{m}.ci_lo"), r.get(f"{m}.ci_hi"), fmt),
            ),
            Col(f"vs {out.baseline} (raw p)", lambda r, m=m: versus(r, m)),
        ]
    return make_table("degeneration-table", per_policy(df), cols)


def degeneration_lines(out: AnalysisOutputs) -> list[str]:
    """Which policies' continuations loop or repeat more than the baseline's (raw p < alpha),
    each with its Δppl, lowest Δppl first: text that loops where perplexity barely moves."""
    df = out.table("degeneration")
    if df.empty or "p_raw" not in df.columns:
        return []
    alpha = float(out.params.get("alpha", 0.05))
    n_tests = int(df["p_raw"].notna().sum())
    many = "model" in df.columns and df["model"].nunique() > 1
    lines = []
    for r in per_policy(df):
        worse = [
            f"{MEASURES[m][0]} {num(r.get(f'{m}.mean'), MEASURES[m][1])} vs "
            f"{num(r.get(f'{m}.baseline_mean'), MEASURES[m][1])} ({r.get(f'{m}.test')} p "
            f"{num(r.get(f'{m}.p_raw'))})"
            for m in MEASURES
            if finite(r.get(f"{m}.p_raw"))
            and float(r[f"{m}.p_raw"]) < alpha
            and float(r.get(f"{m}.diff") or 0) > 0
        ]
        if worse:
            flat = finite(r.get("dppl_ci_lo")) and float(r["dppl_ci_lo"]) <= 0
            where = f"{r['model']} " if many else ""
            lines.append(
                f"{where}{r['policy']} (f={float(r['fraction']):g}): {'; '.join(worse)}, at Δppl "
                f"{dppl_text(r)}%{' (its interval includes 0)' if flat else ''}."
            )
    if not lines:
        return [
            f"No policy's continuations loop or repeat more than {out.baseline}'s at raw p < "
            f"{alpha:g} ({n_tests} paired tests)."
        ]
    return lines + [f"p values are raw: not corrected for the {n_tests} paired tests."]


def fig_degeneration(fd: FigureData) -> plt.Figure:
    """Per model and task: the share ending in a loop and the repeated 4-gram share (with
    their intervals) against Δppl %, one numbered point per emulated policy."""
    df = fd.out.table("degeneration")
    recs = pd.DataFrame(per_policy(df))
    recs = recs[recs["dppl_pct"].map(finite)]
    groups = list(recs.groupby([k for k in ("model", "task") if k in recs.columns], sort=True))
    fig, axes = panels(max(len(groups), 1), 2)
    labelled = []
    for row, (key, g) in zip(axes, groups, strict=False):
        for ax, m in zip(row, ("ends_in_loop", "rep4"), strict=True):
            y = g[f"{m}.mean"].astype(float)
            yerr = np.abs(np.vstack([y - g[f"{m}.ci_lo"], g[f"{m}.ci_hi"] - y]).astype(float))
            xerr = np.abs(
                np.vstack([g["dppl_pct"] - g["dppl_ci_lo"], g["dppl_ci_hi"] - g["dppl_pct"]])
            ).astype(float)
            ax.errorbar(g["dppl_pct"], y, xerr=xerr, yerr=yerr, fmt="o", ms=4, lw=0.8)
            if g["dppl_ci_hi"].max() > 50:  # substitute_all far right: keep the rest apart
                ax.set_xscale("symlog", linthresh=1.0)
            ax.set_xlabel(f"Δppl % vs {fd.out.baseline} ({fd.ci})")
            ax.set_ylabel(f"{MEASURES[m][0]} ({fd.ci})")
            where = " ".join(str(k) for k in np.atleast_1d(key) if k)
            ax.set_title(f"{where}: {int(g[f'{m}.n'].max())} prompts", fontsize=8)
            labelled.append((ax, g.assign(**{m: y}), "dppl_pct", m))
    return finish(fig, fd, labelled)
