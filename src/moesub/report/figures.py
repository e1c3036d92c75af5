"""The report's figures (seaborn, Agg backend), one function per figure, one panel row per model
(the shared drawing helpers are `moesub.report.plotting`).

Scatter points carry the policy's number from the report's policy table (`numbers`); a key
beside each figure maps numbers to names, and `labels.place_labels` keeps the numbers apart.
Each figure is written as a PNG (for Snakemake's `report()` tag) and embedded as a data URI.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moesub.report.degeneration import fig_degeneration  # noqa: E402
from moesub.report.design import fig_design  # noqa: E402
from moesub.report.factorial import fig_factorial  # noqa: E402
from moesub.report.finding_figures import fig_admission, fig_expb, fig_mass  # noqa: E402
from moesub.report.load import column, finite, lacking, regime_wide  # noqa: E402
from moesub.report.plotting import (  # noqa: E402
    FRONT_MARKERS,
    Figure,
    FigureData,
    finish,
    front_or_study,
    front_words,
    legend_below,
    panels,
    png_data_uri,
    rows_of,
    symlog_if_wide,
)


def fig_speed(fd: FigureData) -> plt.Figure:
    """Per model: time per token vs Δppl with its CI; numbers on the Pareto front and the
    study's policies only (where policies crowd, every number would pile up)."""
    sq = fd.table("speed_quality")
    src = "engine" if (sq["source"] == "engine").any() else "simulate"
    sq = sq[sq["source"] == src].assign(ms_per_token=lambda d: 1e3 * d["time_per_token_s"])
    models = fd.models(sq)
    fig, axes = panels(len(models), 1)
    labelled = []
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(sq, model)
        sns.scatterplot(
            data=g.assign(front=front_words(g, "frontier")),
            x="ms_per_token",
            y="dppl_pct",
            hue="device",
            style="front",
            markers=FRONT_MARKERS,
            s=40,
            ax=ax,
        )
        yerr = np.vstack([g["dppl_pct"] - g["dppl_ci_lo"], g["dppl_ci_hi"] - g["dppl_pct"]])
        ax.errorbar(
            g["ms_per_token"],
            g["dppl_pct"],
            yerr=np.nan_to_num(np.abs(yerr.astype(float))),
            fmt="none",
            ecolor="grey",
            elinewidth=0.8,
        )
        for _, front in g[g["frontier"]].groupby(["fraction", "device"]):
            front = front.sort_values("ms_per_token")
            ax.plot(front["ms_per_token"], front["dppl_pct"], "--", color="black", lw=0.8)
        symlog_if_wide(ax, g["dppl_pct"])
        ax.set_xlabel(f"time per token, ms ({src})")
        ax.set_ylabel(f"Δppl % ({fd.ci} over streams)")
        where = f"{model}: " if model else ""
        ax.set_title(
            f"{where}speed/quality, dashed: Pareto frontier; n = {len(g)} runs", fontsize=8
        )
        legend_below(ax, 4)
        labelled.append((ax, g[front_or_study(g, "frontier")], "ms_per_token", "dppl_pct"))
    return finish(fig, fd, labelled)


def fig_regime(fd: FigureData) -> plt.Figure:
    """Per model: hit rate and Belady bound per layer, effective experts, weights by rank, reuse."""
    reg = regime_wide(fd.out)
    models = fd.models(reg)
    fig, axes = panels(len(models), 4, width=3.6)
    for (a1, a2, a3, a4), model in zip(axes, models, strict=True):
        g = rows_of(reg, model)
        lay = g[g["layer"] >= 0].sort_values("layer")
        where = f"{model}: " if model else ""
        a1.plot(lay["layer"], lay["hit_rate"], "o-", label="fetch_every_miss (LRU)")
        a1.plot(lay["layer"], lay["belady_hit_rate"], "s--", label="Belady bound")
        total = g[g["layer"] == -1]
        total = total.iloc[0] if len(total) else g.iloc[0]
        for key, who in (
            ("ref_hit_rate", "reference model"),
            ("trace_ref_hit_rate", "trace study"),
        ):
            if finite(total.get(key)):
                a1.axhline(total[key], color="grey", ls=":", lw=0.8)
                a1.annotate(f"{who} {total[key]:g}", (0, total[key]), fontsize=6)
        a1.set_ylim(0, 1)
        a1.set_xlabel("layer")
        a1.set_ylabel("hit rate")
        a1.set_title(f"{where}hit rate per layer", fontsize=8)
        a1.legend(fontsize=6)
        a2.bar(lay["layer"], lay["effective_experts"], color="C2")
        if finite(lay["capacity"].iloc[0]):
            a2.axhline(float(lay["capacity"].iloc[0]), color="red", ls="--", lw=0.8, label="C")
            a2.legend(fontsize=6)
        for ax in (a1, a2):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        a2.set_xlabel("layer")
        a2.set_ylabel("effective experts")
        a2.set_title(f"{where}effective experts (exp entropy of counts)", fontsize=8)
        ranks = sorted(
            (int(c.removeprefix("weight_rank")), c)
            for c in g.columns
            if c.startswith("weight_rank")
        )
        a3.bar([r for r, _ in ranks], [total[c] for _, c in ranks], color="C0")
        a3.axhline(0.15, color="red", ls="--", lw=0.8, label="0.15 threshold")
        a3.xaxis.set_major_locator(MaxNLocator(integer=True))
        a3.set_xlabel("rank")
        a3.set_ylabel("mean gate weight (top-k renormalized)")
        a3.set_title(f"{where}gate weight by rank", fontsize=8)
        a3.legend(fontsize=6)
        reuse = [c for c in g.columns if c.startswith("reuse_") and finite(total.get(c))]
        a4.bar(
            [c.removeprefix("reuse_").replace("_", "-") for c in reuse],
            [total[c] for c in reuse],
            color="C4",
        )
        a4.tick_params(axis="x", rotation=45, labelsize=6)
        a4.set_xlabel("reuse distance, tokens")
        a4.set_ylabel("share of selections")
        a4.set_title(f"{where}reuse distance of expert selections", fontsize=8)
    fig.tight_layout()
    return fig


def fig_layers(fd: FigureData) -> plt.Figure:
    """Per model and fraction: simulated hit rate per policy (rows, in the policy table's
    order) and layer (columns) as a heatmap: every policy readable, no legend over lines."""
    lay = fd.table("layer_hit_rates")
    models = fd.models(lay)
    fracs = sorted(lay["fraction"].unique())
    n_pol = lay["policy"].nunique()
    n_lay = lay["layer"].nunique()
    size = (max(4.0, 1.6 + 0.45 * n_lay), max(2.5, 0.9 + 0.24 * n_pol))
    fig, axes = plt.subplots(
        len(models),
        len(fracs),
        squeeze=False,
        figsize=(size[0] * len(fracs), size[1] * len(models)),
    )
    for row, model in zip(axes, models, strict=True):
        for ax, frac in zip(row, fracs, strict=True):
            g = rows_of(lay, model)
            g = g[g["fraction"] == frac]
            grid = g.pivot_table(index="policy", columns="layer", values="hit_rate")
            names = sorted(grid.index, key=lambda n: fd.numbers.get(n, 10**6))
            grid = grid.loc[names]
            grid.index = [f"{fd.numbers.get(n, '?')}  {n}" for n in names]
            sns.heatmap(
                grid,
                ax=ax,
                cmap="viridis",
                vmin=0,
                vmax=1,
                annot=n_lay <= 16,
                fmt=".2f",
                annot_kws={"fontsize": 6},
                cbar_kws={"label": "hit rate (simulated)"},
            )
            ax.set_xlabel("layer")
            ax.set_ylabel("")
            ax.tick_params(axis="y", labelsize=7)
            where = f"{model}: " if model else ""
            tokens = int(g["tokens"].max()) if len(g) else 0
            ax.set_title(
                f"{where}per-layer hit rate, fraction {frac:g}, {tokens} tokens", fontsize=8
            )
    fig.tight_layout()
    return fig


def fig_sim_engine(fd: FigureData) -> plt.Figure:
    se = fd.table("sim_vs_engine")
    se = se.assign(engine_ms=1e3 * se["time_mean_s"], sim_ms=1e3 * se["est_time_per_token_s"])
    models = fd.models(se)
    fig, axes = panels(len(models), 1)
    labelled = []
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(se, model)
        sns.scatterplot(data=g, x="engine_ms", y="sim_ms", hue="device", ax=ax, s=40)
        legend_below(ax, 4)
        lim = [0, 1.1 * float(max(g["engine_ms"].max(), g["sim_ms"].max()))]
        ax.plot(lim, lim, "--", color="grey", lw=0.8)
        ax.set_xlabel("engine mean time per token, ms")
        ax.set_ylabel("simulator estimate, ms")
        med = 100 * float(g["rel_error"].abs().median())
        where = f"{model}: " if model else ""
        ax.set_title(f"{where}n = {len(g)}; median |relative error| {med:.1f}%", fontsize=8)
        labelled.append((ax, g, "engine_ms", "sim_ms"))
    return finish(fig, fd, labelled)


def fig_generation(fd: FigureData) -> plt.Figure:
    gen = fd.table("generation")
    lo, hi = column(gen, "ci_low", "acc_ci_lo"), column(gen, "ci_high", "acc_ci_hi")
    agree = column(gen, "agreement", "agree_exact")
    # the graded tasks (a free continuation has no accuracy: the degeneration figure shows it)
    tasks = sorted(gen.loc[gen["accuracy"].notna(), "task"].unique())
    models = fd.models(gen)
    fig, axes = panels(len(models), max(len(tasks), 1), sharex=True)
    if not tasks:
        axes[0, 0].set_title("no graded task ran (the continuation: see its degeneration)")
        return fig
    for row, model in zip(axes, models, strict=True):
        for ax, task in zip(row, tasks, strict=True):
            g = rows_of(gen, model)
            g = g[g["task"] == task].sort_values("policy")
            many = "fraction" in g and g["fraction"].nunique() > 1
            lab = [
                f"{p} (f={f:g})" if many else str(p)
                for p, f in zip(g["policy"], g.get("fraction", g["policy"]), strict=True)
            ]
            err = np.vstack([g["accuracy"] - g[lo], g[hi] - g["accuracy"]]).astype(float)
            ax.barh(lab, g["accuracy"], xerr=np.abs(err), color="C0", alpha=0.8)
            if agree:
                ax.plot(g[agree], lab, "o", color="C3", label="agreement")
                ax.legend(fontsize=7)
            ax.set_xlim(0, 1)
            ax.set_xlabel(f"accuracy ({fd.ci}, Wilson)")
            where = f"{model}: " if model else ""
            lo_n, hi_n = (int(g["n"].min()), int(g["n"].max())) if len(g) else (0, 0)
            n = f"n = {lo_n}" if lo_n == hi_n else f"n = {lo_n}–{hi_n}"
            ax.set_title(f"{where}{task}, {n} problems", fontsize=8)
    fig.tight_layout()
    return fig


def fig_per_input(fd: FigureData) -> plt.Figure:
    pts = fd.table("per_input_points")
    pts = pts[(pts["level"] == "stream") & (pts["policy"] != fd.out.baseline)]
    models = fd.models(pts)
    fig, axes = panels(len(models), 1)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(pts, model)
        mass = column(g, "mass_per_token_layer", "mass_mean")
        sns.scatterplot(data=g, x=mass, y="dnll_mean", hue="policy", ax=ax, s=18)
        ax.legend(
            fontsize=6,
            ncol=1 + len(set(g["policy"])) // 16,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            frameon=False,
        )
        ax.set_xlabel("per-stream mean mass per token-layer")
        ax.set_ylabel(f"per-stream mean ΔNLL vs {fd.out.baseline}")
        where = f"{model}: " if model else ""
        ax.set_title(f"{where}n = {g['unit'].nunique()} streams per policy", fontsize=8)
    fig.tight_layout()
    return fig


# (name, title, table it needs, analysis part that makes it, caption, draw)
FIGURES: list[tuple[str, str, str, str, str, Callable[[FigureData], plt.Figure]]] = [
    (
        "mass_vs_dppl",
        "Mass hypothesis",
        "mass_points",
        "mass_hypothesis",
        "Mean substituted gate mass per token-layer vs perplexity increase, one point per "
        "policy (numbers: the policy table's #). Left: the points r is computed over, one colour "
        "per cluster of mass, with their least-squares line; right: every emulated policy, the "
        "lossless ones and substitute_all (not points of r) set against that line.",
        fig_mass,
    ),
    (
        "speed_quality",
        "Speed / quality frontier",
        "speed_quality",
        "speed_quality",
        "Time per token vs Δppl %; the dashed line joins the Pareto-optimal policies. Numbers "
        "(the policy table's #): the policies on the front and the study's quality and speed "
        "policies; every policy is in the policy table.",
        fig_speed,
    ),
    (
        "design_space",
        "Design space: quality vs speed by family",
        "design_space",
        "design_space",
        "Estimated time per token (simulator cost model; prefetches priced as background copies) "
        "vs Δppl % (emulated policies, with their CI; lossless policies at 0 by construction) "
        "and vs the gate mass substituted or rerouted per token-layer (every simulated policy), "
        "one colour per "
        "family; Belady bounds are left out (they need the future). The dashed line joins the "
        "Pareto-optimal policies: the families on it dominate. Numbers: the policies on each "
        "front and the study's quality and speed policies (every policy: the table below).",
        fig_design,
    ),
    (
        "admission",
        "Admission gain vs tokens since topic change",
        "admission",
        "admission",
        "ΔNLL of each admission policy minus its no-admission twin, binned by tokens since the "
        "document's first token; solid: after a topic change, dashed: each stream's first "
        "document (its cache warm from the initial set).",
        fig_admission,
    ),
    (
        "expb",
        "Experiment B",
        "expb",
        "expb",
        "Realized mass per design and condition against the target m*; then each design's "
        "effect (heavy − light, in that design's units) with its CI per target, on its own "
        "scale; an invalid target is a red x and does not set the scale of valid ones.",
        fig_expb,
    ),
    (
        "expb_factorial",
        "Experiment B: factorial design",
        "expb_factorial_cells",
        "expb_factorial",
        "Left: each cell's ΔNLL per substituted token-layer against the realized gate weight of "
        "the substituted expert, one line per rank bucket (the slope: weight at a fixed rank; "
        "the gap between the lines: rank at a fixed weight). Right: every test's estimate with "
        "its t interval over streams (the one its t-test inverts); grey: ± the minimum "
        "detectable effect.",
        fig_factorial,
    ),
    (
        "regime",
        "Model regime",
        "regime",
        "regime",
        "Per layer: fetch_every_miss hit rate and its Belady bound (dotted: reference figures), "
        "effective experts (dashed: cache capacity C); over all layers: mean gate weight by rank "
        "and the reuse-distance distribution of expert selections.",
        fig_regime,
    ),
    (
        "layer_hit_rates",
        "Per-layer hit rates",
        "layer_hit_rates",
        "simulate",
        "Simulated hit rate of each MoE layer's cache, one row per policy (the policy table's "
        "# and name) and one column per layer.",
        fig_layers,
    ),
    (
        "sim_vs_engine",
        "Simulator vs engine time",
        "sim_vs_engine",
        "sim_vs_engine",
        "The cost model's estimated time per token against the engine's measured mean.",
        fig_sim_engine,
    ),
    (
        "generation",
        "Generation",
        "generation",
        "generation",
        "Accuracy per task and policy with Wilson CIs; dots: agreement with fetch_every_miss.",
        fig_generation,
    ),
    (
        "degeneration",
        "Degeneration of free continuations",
        "degeneration",
        "degeneration",
        "Share of free continuations that end in a loop (Wilson interval) and share of repeated "
        "4-grams (bootstrap over prompts) against Δppl % (bootstrap over streams), one point "
        "per emulated policy: a point high up at the left is text that loops where perplexity "
        "barely moves.",
        fig_degeneration,
    ),
    (
        "per_input",
        "Per-input mass vs ΔNLL",
        "per_input_points",
        "per_input",
        "Per stream, within each policy: does a stream's mass predict its quality loss?",
        fig_per_input,
    ),
]


def draw_figures(fd: FigureData, fig_dir: Path) -> list[Figure]:
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.8)
    out = []
    for name, title, table, part, caption, draw in FIGURES:
        f = Figure(name=name, title=title, caption=caption)
        df = fd.out.table(table)
        if df.empty:
            f.missing = fd.out.why_missing(part, table)
        elif lacking(df, name):
            f.missing = f"{table}.parquet lacks column(s) {', '.join(lacking(df, name))}"
        else:
            f.png = fig_dir / f"{name}.png"
            f.data_uri = png_data_uri(draw(fd), f.png)
        out.append(f)
    return out
