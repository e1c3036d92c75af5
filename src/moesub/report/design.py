"""The design-space section (policy v2 families, `moesub.stats.design`): every simulated policy
with its family, hit rate, misses per token, estimated time per token, Δppl and its gap to the
Belady bound; the best policy of each family beside the study's quality and speed policies; and
the quality vs speed figure whose Pareto front shows which families dominate.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402

from moesub.report.load import AnalysisOutputs, ci_label, finite  # noqa: E402
from moesub.report.plotting import (  # noqa: E402
    FRONT_MARKERS,
    STUDY_POLICIES,
    FigureData,
    finish,
    front_or_study,
    front_words,
    legend_below,
    panels,
    rows_of,
    symlog_if_wide,
)
from moesub.report.tables import Col, Row, Table, interval, make_table, num, text  # noqa: E402

FAMILY_LABELS = {
    "study": "study rules (fetch / substitute / threshold / first choice, LRU / LFU, admission)",
    "host_compute": "every miss computed on the host",
    "prefetch": "speculative prefetch from the lookahead logits",
    "cache_prior": "cache-aware routing (route_bias)",
    "hybrid": "light misses computed exactly on the host",
    "buddy": "co-activation substitutes",
}
SOURCE_LABELS = {"emulated": "", "exact": " (exact: lossless)"}


def dppl_cell(r: Row, prefix: str = "") -> str:
    """Δppl % with its interval, or why there is none."""
    v = r.get(f"{prefix}dppl_pct")
    source = r.get(f"{prefix}dppl_source")
    if not finite(v):
        return "not emulated"
    iv = interval(r.get(f"{prefix}dppl_ci_lo"), r.get(f"{prefix}dppl_ci_hi"), "{:+.2f}")
    iv = f" {iv}" if iv != "—" else ""
    return f"{float(v):+.2f}{iv}{SOURCE_LABELS.get(str(source), '')}"


def gap_cell(r: Row) -> str:
    if r.get("bound"):
        return "(is a bound)"
    if not finite(r.get("belady_gap")):
        return "—"
    return f"{100 * float(r['belady_gap']):+.1f} pts ({r.get('belady_policy')})"


def fronts_cell(r: Row) -> str:
    marks = [m for m, key in (("Δppl", "frontier"), ("mass", "frontier_mass")) if r.get(key)]
    return ", ".join(marks) or "—"


def design_space_table(out: AnalysisOutputs, numbers: dict[str, int]) -> Table:
    ds = out.table("design_space")
    if ds.empty:
        return make_table("design-table", [], [])
    ci = ci_label(out.ci_level)
    cols = [
        Col("model", text("model"), False),
        Col("fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("#", lambda r: str(numbers.get(str(r["policy"]), "?"))),
        Col("policy", text("policy"), False),
        Col("family", text("family"), False),
        Col("hit rate", lambda r: num(r.get("hit_rate"), "{:.3f}")),
        Col("misses / token", lambda r: num(r.get("misses_per_token"), "{:.2f}")),
        Col("prefetches / token", lambda r: num(r.get("prefetches_per_token"), "{:.2f}")),
        Col("mass / token-layer", lambda r: num(r.get("mass_per_token_layer"), "{:.4f}")),
        Col("rerouted / token-layer", lambda r: num(r.get("rerouted_per_token_layer"), "{:.4f}")),
        Col("est. ms / token", lambda r: num(1e3 * float(r["est_time_per_token_s"]), "{:.3f}")),
        Col(f"Δppl % ({ci})", dppl_cell),
        Col("gap to Belady bound (hit rate)", gap_cell),
        Col("Pareto front", fronts_cell, False),
    ]
    order = out.by_model(ds, "fraction", "bound", "est_time_per_token_s")
    return make_table(
        "design-table",
        order.to_dict("records"),
        cols,
        attrs=lambda r: {"policy": str(r["policy"]), "family": str(r["family"])},
    )


def design_families_table(out: AnalysisOutputs) -> Table:
    fam = out.table("design_families")
    if fam.empty:
        return make_table("design-families", [], [])
    ci = ci_label(out.ci_level)
    cols = [
        Col("model", text("model"), False),
        Col("fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("family", lambda r: f"{r['family']}: {FAMILY_LABELS.get(str(r['family']), '')}", False),
        Col("policies", lambda r: num(r.get("n_policies"), "{:.0f}")),
        Col("best policy", lambda r: f"{r['best_policy']} ({r.get('best_by')})", False),
        Col("misses / token", lambda r: num(r.get("best_misses_per_token"), "{:.2f}")),
        Col("est. ms / token", lambda r: num(1e3 * float(r["best_time_per_token_s"]), "{:.3f}")),
        Col(f"Δppl % ({ci})", lambda r: dppl_cell(r, "best_")),
        Col("gap to Belady", lambda r: pct_pts(r.get("best_belady_gap"))),
        Col("on the Δppl / mass fronts", lambda r: f"{r['on_frontier']} / {r['on_frontier_mass']}"),
    ]
    return make_table(
        "design-families",
        fam.to_dict("records"),
        cols,
        attrs=lambda r: {"family": str(r["family"])},
    )


def pct_pts(v: object) -> str:
    return f"{100 * float(v):+.1f} pts" if finite(v) else "—"


def design_lines(out: AnalysisOutputs) -> list[str]:
    """Per model and fraction: which families the time vs Δppl front holds, and each family's
    best policy against the study's quality and speed policies."""
    fam = out.table("design_families")
    lines = []
    if fam.empty:
        return lines
    keys = [c for c in ("model", "fraction") if c in fam.columns]
    for key, g in out.by_model(fam, "fraction").groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        where = ", ".join(f"{k} {v}" for k, v in zip(keys, key, strict=True))
        front = [f"{r.family} ({r.on_frontier})" for r in g.itertuples() if r.on_frontier > 0]
        lines.append(
            f"{where}: the time vs Δppl front holds "
            + (", ".join(front) if front else "no family (no policy with a known Δppl)")
            + "."
        )
        r0 = g.iloc[0]
        refs = "; ".join(  # only the study's policies the config defines
            f"{ref}: Δppl {num(r0.get(f'{ref}_dppl_pct'), '{:+.2f}')}%, "
            f"{num(r0.get(f'{ref}_misses_per_token'), '{:.2f}')} misses/token"
            for ref in STUDY_POLICIES
            if out.configured(ref) and finite(r0.get(f"{ref}_misses_per_token"))
        )
        best = "; ".join(
            f"{r.family} → {r.best_policy}: Δppl "
            f"{num(r.best_dppl_pct, '{:+.2f}')}%, {num(r.best_misses_per_token, '{:.2f}')} "
            "misses/token"
            for r in g.itertuples()
        )
        refs = f" (study references: {refs})" if refs else ""
        lines.append(f"{where}: best of each family — {best}{refs}.")
    return lines


def fig_design(fd: FigureData) -> plt.Figure:
    """Per model: estimated time per token vs Δppl (policies with a known Δppl) and vs the
    substituted mass (every simulated policy), coloured by family; dashed: the Pareto front."""
    ds = fd.table("design_space")
    ds = ds[~ds["bound"].astype(bool)].assign(ms=lambda d: 1e3 * d["est_time_per_token_s"])
    models = fd.models(ds)
    fig, axes = panels(len(models), 2)
    palette = dict(zip(FAMILY_LABELS, sns.color_palette("deep", len(FAMILY_LABELS)), strict=True))
    labelled = []
    for (a1, a2), model in zip(axes, models, strict=True):
        g = rows_of(ds, model)
        where = f"{model}: " if model else ""
        for ax, y, front, ylabel, what in (
            (a1, "dppl_pct", "frontier", "Δppl % (emulated; lossless = 0)", "quality vs speed"),
            (a2, "moved_mass_per_token_layer", "frontier_mass",
             "gate mass substituted or rerouted / token-layer", "every simulated policy"),
        ):  # fmt: skip
            pts = g[np.isfinite(g[y].to_numpy(float))]
            if pts.empty:
                ax.set_title(f"{where}{what}: no points", fontsize=8)
                continue
            sns.scatterplot(
                data=pts.assign(front=front_words(pts, front)),
                x="ms",
                y=y,
                hue="family",
                style="front",
                markers=FRONT_MARKERS,
                palette=palette,
                s=40,
                ax=ax,
            )
            for _, fr in pts[pts[front].astype(bool)].groupby("fraction"):
                fr = fr.sort_values("ms")
                ax.plot(fr["ms"], fr[y], "--", color="black", lw=0.8)
            if y == "dppl_pct":
                yerr = np.vstack([pts[y] - pts["dppl_ci_lo"], pts["dppl_ci_hi"] - pts[y]])
                ax.errorbar(pts["ms"], pts[y], yerr=np.nan_to_num(np.abs(yerr.astype(float))),
                            fmt="none", ecolor="grey", elinewidth=0.8)  # fmt: skip
                symlog_if_wide(ax, pts[y])
            ax.set_xlabel("estimated time per token, ms (simulator cost model)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{where}{what}; dashed: Pareto front", fontsize=8)
            legend_below(ax, 3)
            labelled.append((ax, pts[front_or_study(pts, front)], "ms", y))
    return finish(fig, fd, labelled)
