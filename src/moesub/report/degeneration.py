"""The degeneration section (`moesub.stats.degeneration`): per policy, how its free
continuations repeat and loop, beside its Δppl, each with an interval over prompts and a paired
test against the baseline (its raw p and the p adjusted in the exploratory family,
`tests.parquet`); the figure (loop share and repeated 4-grams against Δppl); and the sentences
that say whether a policy makes text loop where perplexity barely moves.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from moesub.report.claims import p_text, test_of  # noqa: E402
from moesub.report.load import AnalysisOutputs, ci_label, finite  # noqa: E402
from moesub.report.plotting import FigureData, finish, panels, rows_of  # noqa: E402
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


def test_for(out: AnalysisOutputs, r: Row, m: str) -> Row:
    """The row of `tests.parquet` of measure `m`'s paired test (empty when there is none)."""
    name = r.get(f"{m}.test_name")
    if not name or not isinstance(name, str):
        return {}
    return test_of(out, r.get("model"), kind="degeneration", name=name, fraction=r["fraction"])


def versus(out: AnalysisOutputs, r: Row, m: str) -> str:
    """The paired difference against the baseline, its test, raw and adjusted p."""
    diff = r.get(f"{m}.diff")
    if not finite(diff):
        return "—"
    value = float(diff) * (100 if m in SHARES else 1)
    t = test_for(out, r, m)
    adjusted = f"; adjusted {num(t['p_adjusted'], '{:.2g}')}" if finite(t.get("p_adjusted")) else ""
    raw = num(r.get(f"{m}.p_raw"), "{:.2g}")
    return f"{MEASURES[m][2].format(value)} ({r.get(f'{m}.test')} p {raw}{adjusted})"


def degeneration_table(out: AnalysisOutputs) -> Table:
    """Per policy: Δppl %, then each measure's mean with its interval and the paired
    difference against the baseline (test, raw and adjusted p)."""
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
            Col(f"vs {out.baseline} (p raw; adjusted)", lambda r, m=m: versus(out, r, m)),
        ]
    return make_table("degeneration-table", per_policy(df), cols)


def degeneration_lines(out: AnalysisOutputs) -> list[str]:
    """Which policies' continuations loop or repeat more than the baseline's (adjusted p <
    alpha in the exploratory family), each with its Δppl, lowest Δppl first: text that loops
    where perplexity barely moves."""
    df = out.table("degeneration")
    if df.empty or "p_raw" not in df.columns:
        return []
    alpha = float(out.params.get("alpha", 0.05))
    many = "model" in df.columns and df["model"].nunique() > 1
    lines, tested = [], []
    for r in per_policy(df):
        worse = []
        for m, (label, fmt, _) in MEASURES.items():
            t = test_for(out, r, m)
            tested += [t] if finite(t.get("p_value")) else []
            if finite(t.get("p_adjusted")) and t["p_adjusted"] < alpha and t["estimate"] > 0:
                worse.append(
                    f"{label} {num(r.get(f'{m}.mean'), fmt)} vs "
                    f"{num(r.get(f'{m}.baseline_mean'), fmt)} ({r.get(f'{m}.test')} test, "
                    f"{p_text(t)})"
                )
        if worse:
            flat = finite(r.get("dppl_ci_lo")) and float(r["dppl_ci_lo"]) <= 0
            where = f"{r['model']} " if many else ""
            lines.append(
                f"{where}{r['policy']} (f={float(r['fraction']):g}): {'; '.join(worse)}, at Δppl "
                f"{dppl_text(r)}%{' (its interval includes 0)' if flat else ''}."
            )
    if not tested:
        return ["No paired degeneration test (tests.parquet has none): no adjusted p to quote."]
    sizes = "/".join(str(n) for n in sorted({int(t["family_size"]) for t in tested}))
    family = f"the exploratory family ({sizes} tests{' per model' if many else ''})"
    if not lines:
        return [
            f"No policy's continuations loop or repeat more than {out.baseline}'s at adjusted "
            f"p < {alpha:g} ({len(tested)} paired tests, adjusted in {family})."
        ]
    adjustment = tested[0]["adjustment"]
    return lines + [
        f"p adjusted by {adjustment} over {family}, the {len(tested)} paired tests among them."
    ]


def fig_degeneration(fd: FigureData) -> plt.Figure:
    """Per model and task: the share ending in a loop and the repeated 4-gram share (with
    their intervals) against Δppl %, one numbered point per emulated policy."""
    recs = pd.DataFrame(per_policy(fd.table("degeneration")))
    recs = recs[recs["dppl_pct"].map(finite)]
    groups = [
        (f"{model} {task}".strip(), g)
        for model in fd.models(recs)
        for task, g in rows_of(recs, model).groupby("task", sort=True)
    ]
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
            ax.set_title(f"{key}: {int(g[f'{m}.n'].max())} prompts", fontsize=8)
            labelled.append((ax, g.assign(**{m: y}), "dppl_pct", m))
    return finish(fig, fd, labelled)
