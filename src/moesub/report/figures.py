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
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moesub.report.design import fig_design  # noqa: E402
from moesub.report.load import column, finite, lacking, regime_wide, unique  # noqa: E402
from moesub.report.plotting import (  # noqa: E402
    Figure,
    FigureData,
    finish,
    models_of,
    panels,
    png_data_uri,
    rows_of,
    symlog_if_wide,
)


def fig_mass(fd: FigureData) -> plt.Figure:
    pts = fd.out.table("mass_points")
    mass = column(pts, "mass_per_token_layer", "mass_mean")
    res = {
        (str(r.get("model", "")), r["fraction"], r["group"]): r
        for r in fd.out.doc.get("mass_hypothesis", [])
    }
    models = models_of(pts)
    fig, axes = panels(len(models), 2)
    labelled = []
    for (a1, a2), model in zip(axes, models, strict=True):
        mp = rows_of(pts, model)
        first = mp[mp["group"] == "fetches first choice"]
        first = first.assign(fraction=first["fraction"].map("f={:g}".format))
        sns.scatterplot(
            data=first, x=mass, y="dppl_pct", hue="fraction", palette="deep", s=40, ax=a1
        )
        for _, g in first.groupby("fraction"):
            if len(g) >= 2 and g[mass].nunique() > 1:
                slope, icpt = np.polyfit(g[mass], g["dppl_pct"], 1)
                xs = np.linspace(0, g[mass].max() * 1.05, 20)
                a1.plot(xs, slope * xs + icpt, "--", color="grey", lw=0.8)
        rs = [
            f"f={f:g}: r = {r['r']:.3f}" if r.get("r") is not None else f"f={f:g}: r undefined"
            for (m, f, g), r in sorted(res.items())
            if m == model and g == "fetches first choice"
        ]
        where = f"{model}: " if model else ""
        a1.set_title(f"{where}fetch the first choice ({'; '.join(rs)})", fontsize=8)
        a1.set_xlabel("mean substituted gate mass per token-layer")
        a1.set_ylabel(f"Δppl % vs {fd.out.baseline}")
        sns.scatterplot(data=mp, x=mass, y="dppl_pct", hue="group", s=40, ax=a2)
        symlog_if_wide(a2, mp["dppl_pct"])
        a2.set_title(f"{where}all substituting policies", fontsize=8)
        a2.set_xlabel("mean substituted gate mass per token-layer")
        a2.set_ylabel("Δppl %")
        for ax in (a1, a2):
            if ax.get_legend():
                ax.legend(fontsize=7)
        labelled += [(a1, first, mass, "dppl_pct"), (a2, mp, mass, "dppl_pct")]
    return finish(fig, fd, labelled)


def fig_speed(fd: FigureData) -> plt.Figure:
    sq = fd.out.table("speed_quality")
    src = "engine" if (sq["source"] == "engine").any() else "simulate"
    sq = sq[sq["source"] == src].assign(ms_per_token=lambda d: 1e3 * d["time_per_token_s"])
    models = models_of(sq)
    fig, axes = panels(len(models), 1)
    labelled = []
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(sq, model)
        sns.scatterplot(
            data=g, x="ms_per_token", y="dppl_pct", hue="device", style="frontier", s=40, ax=ax
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
        ax.legend(fontsize=7)
        labelled.append((ax, g, "ms_per_token", "dppl_pct"))
    return finish(fig, fd, labelled)


def fig_admission(fd: FigureData) -> plt.Figure:
    """Per model: ΔNLL vs the exact twin by bin, after a topic change (solid) and in each
    stream's first document (dashed); the boundary token is its own bin."""
    adm = fd.out.table("admission")
    if "segment" not in adm.columns:
        adm = adm.assign(segment="after_change")
    order = adm.sort_values("bin").drop_duplicates("bin_label")["bin_label"].tolist()
    pos = {lab: i for i, lab in enumerate(order)}
    models = models_of(adm)
    fig, axes = panels(len(models), 1, width=7.0)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g_m = rows_of(adm, model)
        pairs = unique(zip(g_m["policy"], g_m["twin"], g_m["fraction"], strict=True))
        for i, (name, twin, frac) in enumerate(pairs):
            for seg, style in (("after_change", "-"), ("first_document", "--")):
                g = g_m[
                    (g_m["policy"] == name)
                    & (g_m["twin"] == twin)
                    & (g_m["fraction"] == frac)
                    & (g_m["segment"] == seg)
                ].sort_values("bin")
                if g.empty:
                    continue
                x = g["bin_label"].map(pos).to_numpy(float) + (0.08 if seg != "after_change" else 0)
                label = f"{name} vs {twin} (f={frac:g}), {seg.replace('_', ' ')}"
                ax.plot(x, g["dnll_mean"], marker="o", ls=style, color=f"C{i}", label=label)
                ax.fill_between(
                    x, g["ci_lo"].astype(float), g["ci_hi"].astype(float), color=f"C{i}", alpha=0.15
                )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(order)), order, rotation=45, fontsize=7)
        ax.set_xlabel("tokens since the document's first token (boundary: the first token)")
        ax.set_ylabel("ΔNLL per token, admission − exact twin")
        ax.legend(fontsize=6)
        where = f"{model}: " if model else ""
        ax.set_title(f"{where}admission gain ({fd.ci} over streams)", fontsize=8)
    fig.tight_layout()
    return fig


def fig_expb(fd: FigureData) -> plt.Figure:
    """Per model: realized masses per design and condition, and the effect with its CI."""
    expb = fd.out.table("expb")
    lo, hi = column(expb, "effect_ci_lo", "ci_lo"), column(expb, "effect_ci_hi", "ci_hi")
    models = models_of(expb)
    fig, axes = panels(len(models), 2)
    for (a1, a2), model in zip(axes, models, strict=True):
        g = rows_of(expb, model).sort_values(["design", "target_mass"])
        long = g.melt(
            id_vars=["design", "target_mass"],
            value_vars=["realized_heavy", "realized_light"],
            var_name="condition",
            value_name="realized",
        )
        long["condition"] = long["design"] + " " + long["condition"].str.removeprefix("realized_")
        long["target"] = long["target_mass"].map("{:g}".format)
        sns.barplot(data=long, x="target", y="realized", hue="condition", ax=a1)
        for i, t in enumerate(sorted(g["target_mass"].unique())):
            a1.plot([i - 0.4, i + 0.4], [t, t], color="black", lw=0.8)
        where = f"{model}: " if model else ""
        a1.set_xlabel("target m* per token-layer (black: m*)")
        a1.set_ylabel("realized mean mass per token-layer")
        a1.set_title(f"{where}realized mass by design and condition", fontsize=8)
        a1.legend(fontsize=6)
        for j, (design, d) in enumerate(g.groupby("design", sort=True)):
            x = np.arange(len(d)) + 0.15 * j
            y = d["effect"].to_numpy(float)
            err = np.vstack([y - d[lo].to_numpy(float), d[hi].to_numpy(float) - y]) if lo else None
            a2.errorbar(
                x,
                y,
                yerr=None if err is None else np.abs(np.nan_to_num(err)),
                fmt="o",
                label=design,
                color=f"C{j}",
                capsize=3,
            )
            for xi, yi, valid in zip(x, y, d["valid"], strict=True):
                if not valid:
                    a2.plot(xi, yi, "x", color="red", ms=9)
        targets = sorted(g["target_mass"].unique())
        a2.set_xticks(range(len(targets)), [f"{t:g}" for t in targets])
        a2.axhline(0, color="black", lw=0.8)
        a2.set_xlabel("target m* per token-layer (red x: invalid)")
        a2.set_ylabel(f"effect heavy − light ({fd.ci})")
        a2.set_title(f"{where}effect by design", fontsize=8)
        a2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_regime(fd: FigureData) -> plt.Figure:
    """Per model: hit rate and Belady bound per layer, effective experts, weights by rank, reuse."""
    reg = regime_wide(fd.out)
    models = models_of(reg)
    skew = "top_coverage" in reg.columns
    fig, axes = panels(len(models), 5 if skew else 4, width=3.6)
    for (a1, a2, a3, a4, *a5), model in zip(axes, models, strict=True):
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
        if a5:
            skew_panel(a5[0], lay, where)
    fig.tight_layout()
    return fig


def skew_panel(ax: plt.Axes, lay: pd.DataFrame, where: str) -> None:
    """Per layer: top-C coverage of the model, the real model and the skew-matched trace (bars),
    and what the calibration's first C cover of the evaluation selections (markers)."""
    x = lay["layer"].to_numpy()
    for i, (col, label) in enumerate(
        (("top_coverage", "model"), ("real_top_coverage", "real model"),
         ("matched_top_coverage", "skew-matched"))
    ):  # fmt: skip
        ax.bar(x + (i - 1) * 0.27, lay[col], width=0.27, label=f"top-C, {label}", color=f"C{i}")
    for col, label, marker in (
        ("initial_coverage", "calibration set, model", "o"),
        ("matched_initial_coverage", "calibration set, skew-matched", "s"),
    ):
        ax.plot(x, lay[col], marker, color="black", mfc="none", ms=5, label=label)
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("share of selections covered")
    ax.set_title(f"{where}static skew: top-C coverage (C = 25% of E)", fontsize=8)
    ax.legend(fontsize=5)


def fig_layers(fd: FigureData) -> plt.Figure:
    lay = fd.out.table("layer_hit_rates")
    models = models_of(lay)
    fig, axes = panels(len(models), 1)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(lay, model)
        sns.lineplot(
            data=g, x="layer", y="hit_rate", hue="policy", style="fraction", marker="o", ax=ax
        )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("hit rate (simulated)")
        where = f"{model}: " if model else ""
        ax.set_title(f"{where}per-layer hit rates, {int(g['tokens'].max())} tokens", fontsize=8)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def fig_sim_engine(fd: FigureData) -> plt.Figure:
    se = fd.out.table("sim_vs_engine")
    se = se.assign(engine_ms=1e3 * se["time_mean_s"], sim_ms=1e3 * se["est_time_per_token_s"])
    models = models_of(se)
    fig, axes = panels(len(models), 1)
    labelled = []
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(se, model)
        sns.scatterplot(data=g, x="engine_ms", y="sim_ms", hue="device", ax=ax, s=40)
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
    gen = fd.out.table("generation")
    lo, hi = column(gen, "ci_low", "acc_ci_lo"), column(gen, "ci_high", "acc_ci_hi")
    agree = column(gen, "agreement", "agree_exact")
    tasks = sorted(gen["task"].unique())
    models = models_of(gen)
    fig, axes = panels(len(models), len(tasks), sharex=True)
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
    pts = fd.out.table("per_input_points")
    pts = pts[(pts["level"] == "stream") & (pts["policy"] != fd.out.baseline)]
    models = models_of(pts)
    fig, axes = panels(len(models), 1)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(pts, model)
        mass = column(g, "mass_per_token_layer", "mass_mean")
        sns.scatterplot(data=g, x=mass, y="dnll_mean", hue="policy", ax=ax, s=18)
        ax.set_xlabel("per-stream mean mass per token-layer")
        ax.set_ylabel(f"per-stream mean ΔNLL vs {fd.out.baseline}")
        where = f"{model}: " if model else ""
        ax.set_title(f"{where}n = {g['unit'].nunique()} streams per policy", fontsize=8)
        ax.legend(fontsize=6, ncol=2)
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
        "policy (numbers: the policy table's #); r with a bootstrap CI over streams.",
        fig_mass,
    ),
    (
        "speed_quality",
        "Speed / quality frontier",
        "speed_quality",
        "speed_quality",
        "Time per token vs Δppl %; the dashed line joins the Pareto-optimal policies.",
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
        "Pareto-optimal policies: the families on it dominate.",
        fig_design,
    ),
    (
        "admission",
        "Admission gain vs tokens since topic change",
        "admission",
        "admission",
        "ΔNLL of each admission policy minus its no-admission twin, binned by tokens since the "
        "document's first token.",
        fig_admission,
    ),
    (
        "expb",
        "Experiment B",
        "expb",
        "expb",
        "Realized mass per design and condition against the target m*, and the effect "
        "(ΔNLL heavy − light) with its CI per design and target.",
        fig_expb,
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
        "Simulated hit rate of each MoE layer's cache.",
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
