"""The report's figures (seaborn, Agg backend), one function per figure, one panel row per model.

Scatter points carry the policy's number from the report's policy table (`numbers`); a key
beside each figure maps numbers to names, and `labels.place_labels` keeps the numbers apart.
Each figure is written as a PNG (for Snakemake's `report()` tag) and embedded as a data URI.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from moesub.io import atomic_path  # noqa: E402
from moesub.report.labels import key_text, place_labels  # noqa: E402
from moesub.report.load import AnalysisOutputs, ci_label, column, unique  # noqa: E402

DPI = 110
PANEL = (5.2, 3.6)  # inches per panel


@dataclass
class Figure:
    """One figure of the report: its id, caption, PNG path and inline data URI (or why not)."""

    name: str
    title: str
    caption: str
    png: Path | None = None
    data_uri: str | None = None
    missing: str | None = None


@dataclass
class FigureData:
    """What every figure function gets: the analysis outputs and the policy numbers."""

    out: AnalysisOutputs
    numbers: dict[str, int]

    @property
    def ci(self) -> str:
        return ci_label(self.out.ci_level)


def panels(n_models: int, n_cols: int, **kw) -> tuple[plt.Figure, np.ndarray]:
    """(fig, axes (n_models, n_cols)): one row of panels per model."""
    fig, axes = plt.subplots(
        n_models,
        n_cols,
        figsize=(PANEL[0] * n_cols, PANEL[1] * n_models),
        squeeze=False,
        **kw,
    )
    return fig, axes


def models_of(df: pd.DataFrame) -> list[str]:
    return unique(df["model"].astype(str)) if "model" in df.columns else [""]


def rows_of(df: pd.DataFrame, model: str) -> pd.DataFrame:
    return df[df["model"].astype(str) == model] if "model" in df.columns else df


def finish(
    fig: plt.Figure, fd: FigureData, labelled: list[tuple[plt.Axes, pd.DataFrame, str, str]]
):
    """Lay the figure out, then number the points and add the key of the policies shown."""
    shown: list[str] = []
    for _, df, _, _ in labelled:
        shown.extend(df["policy"].astype(str))
    key = key_text(fd.numbers, shown)
    fig.tight_layout(rect=(0, 0, 0.86 if key else 1, 1))
    for ax, df, x, y in labelled:
        texts = [str(fd.numbers.get(p, "?")) for p in df["policy"].astype(str)]
        place_labels(ax, df[x].to_numpy(float), df[y].to_numpy(float), texts)
    if key:
        fig.text(0.87, 0.98, key, va="top", ha="left", fontsize=7, family="monospace")
    return fig


def symlog_if_wide(ax: plt.Axes, values: pd.Series) -> None:
    v = values.to_numpy(float)
    v = v[np.isfinite(v)]
    if v.size and v.max() > 50:
        ax.set_yscale("symlog", linthresh=1.0)


# ---- figures ------------------------------------------------------------------------------------


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
        sns.scatterplot(data=first, x=mass, y="dppl_pct", hue="fraction", s=40, ax=a1)
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
    adm = fd.out.table("admission")
    order = adm.drop_duplicates("bin_label").sort_values("bin")["bin_label"].tolist()
    pos = {lab: i for i, lab in enumerate(order)}
    models = models_of(adm)
    fig, axes = panels(len(models), 1)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g_m = rows_of(adm, model)
        for (name, twin, frac), g in g_m.groupby(["policy", "twin", "fraction"]):
            g = g.sort_values("bin")
            x = g["bin_label"].map(pos)
            exact = bool(g["twin_exact"].all()) if "twin_exact" in g else True
            label = f"{name} vs {twin} (f={frac:g}{'' if exact else ', eviction differs'})"
            ax.plot(x, g["dnll_mean"], marker="o", ls="-" if exact else ":", label=label)
            ax.fill_between(x, g["ci_lo"].astype(float), g["ci_hi"].astype(float), alpha=0.2)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(order)), order, rotation=45, fontsize=7)
        ax.set_xlabel("tokens since the document's first token")
        ax.set_ylabel("ΔNLL per token, admission − twin")
        ax.legend(fontsize=7)
        where = f"{model}: " if model else ""
        ax.set_title(f"{where}admission gain ({fd.ci} over streams)", fontsize=8)
    fig.tight_layout()
    return fig


def fig_expb(fd: FigureData) -> plt.Figure:
    streams = fd.out.table("expb")
    decisions = {str(e.get("model", "")): e for e in fd.out.doc.get("expb") or []}
    models = models_of(streams)
    fig, axes = panels(len(models), 2)
    for (a1, a2), model in zip(axes, models, strict=True):
        e = decisions.get(model, {})
        dec = e.get("decision", {})
        rows = [
            {"target": f"{t['target_mass']:g}", "condition": c, "realized": t.get(f"realized_{c}")}
            for t in e.get("targets", [])
            for c in ("heavy", "light")
            if t.get(f"realized_{c}") is not None
        ]
        if rows:
            sns.barplot(data=pd.DataFrame(rows), x="target", y="realized", hue="condition", ax=a1)
        where = f"{model}: " if model else ""
        a1.set_xlabel("target mass m* per token-layer")
        a1.set_ylabel("realized mean mass per token-layer")
        a1.set_title(f"{where}realized mass by condition", fontsize=8)
        s = rows_of(streams, model)
        if dec.get("target_mass") is not None and len(s):
            s = s[np.isclose(s["target_mass"], dec["target_mass"])]
        if len(s):
            sns.stripplot(data=s, y="d_per_mass", ax=a2, size=5, color="C2")
            a2.axhline(0, color="black", lw=0.8)
        a2.set_ylabel("ΔNLL/mass heavy − light, per stream")
        a2.set_title(
            f"{where}m* = {dec.get('target_mass', float('nan')):g}: {dec.get('outcome', 'n/a')}; "
            f"n = {len(s)} streams",
            fontsize=8,
        )
    fig.tight_layout()
    return fig


def fig_layers(fd: FigureData) -> plt.Figure:
    lay = fd.out.table("layer_hit_rates")
    models = models_of(lay)
    fig, axes = panels(len(models), 1)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g = rows_of(lay, model)
        sns.lineplot(
            data=g, x="layer", y="hit_rate", hue="policy", style="fraction", marker="o", ax=ax
        )
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
            n = f"n = {int(g['n'].min())}–{int(g['n'].max())}" if len(g) else "no rows"
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
        sns.scatterplot(data=g, x="mass_mean", y="dnll_mean", hue="policy", ax=ax, s=18)
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
        "Realized mass per condition, and the paired per-stream statistic at the primary target.",
        fig_expb,
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


def png_data_uri(fig: plt.Figure, path: Path) -> str:
    """Write `fig` as a PNG at `path` (atomically) and return the same bytes as a data URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = buf.getvalue()
    with atomic_path(path, suffix=".png") as tmp:
        tmp.write_bytes(data)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def draw_figures(fd: FigureData, fig_dir: Path) -> list[Figure]:
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.8)
    out = []
    for name, title, table, part, caption, draw in FIGURES:
        f = Figure(name=name, title=title, caption=caption)
        if fd.out.table(table).empty:
            f.missing = fd.out.why_missing(part, table)
        else:
            f.png = fig_dir / f"{name}.png"
            f.data_uri = png_data_uri(draw(fd), f.png)
        out.append(f)
    return out
