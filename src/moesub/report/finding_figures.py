"""The figures of the study's findings: the mass hypothesis, Experiment B and admission (one
panel row per model; the shared helpers are `moesub.report.plotting`).

Each shows what its section's text discusses: the mass hypothesis only the points r is
computed over (and why the others are out, in the second panel), Experiment B each design on
its own scale (its effect has its own units, and an invalid design's point must not set the
scale of a valid one), admission its legend outside the data.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import seaborn as sns  # noqa: E402

from moesub.report.load import column, unique  # noqa: E402
from moesub.report.plotting import (  # noqa: E402
    FigureData,
    finish,
    legend_below,
    panels,
    rows_of,
    symlog_if_wide,
)

FETCH_FIRST = "fetches first choice"
SEGMENT_STYLE = {  # segment -> (line style, legend words)
    "after_change": ("-", "after a topic change"),
    "first_document": ("--", "first document (warm from the initial set)"),
}


def mass_title(r: dict | None, f: float) -> str:
    if r is None:
        return f"f={f:g}: no result"
    if r.get("r") is None:
        return f"f={f:g}: r not reported ({r.get('n')} points)"
    title = f"f={f:g}: r = {r['r']:.2f} over {r['n']} policies"
    if r.get("within_r") is not None and len(r.get("clusters") or []) > 1:
        title += f"; within {len(r['clusters'])} clusters r = {r['within_r']:.2f}"
    return title


def fig_mass(fd: FigureData) -> plt.Figure:
    """Per model: the points of r (one colour per cluster of mass, the least-squares line);
    every emulated policy by group, substitute_all against the line extended."""
    pts = fd.table("mass_points")
    mass = column(pts, "mass_per_token_layer", "mass_mean")
    if "used" not in pts.columns:  # an analysis before the point set was recorded
        pts = pts.assign(used=pts["group"] == FETCH_FIRST, cluster=0.0)
    res = {
        (str(r.get("model", "")), r["fraction"]): r
        for r in fd.out.doc.get("mass_hypothesis", [])
        if r.get("group", FETCH_FIRST) == FETCH_FIRST
    }
    models = fd.models(pts)
    fig, axes = panels(len(models), 2, width=5.6)
    labelled = []
    for (a1, a2), model in zip(axes, models, strict=True):
        mp = rows_of(pts, model)
        used = mp[mp["used"].astype(bool)]
        used = used.sort_values("cluster").assign(
            cluster=lambda d: d["cluster"].map(lambda c: f"cluster {int(c) + 1}")
        )
        many = mp["fraction"].nunique() > 1
        sns.scatterplot(
            data=used,
            x=mass,
            y="dppl_pct",
            hue="cluster",
            style="fraction" if many else None,
            palette="deep",
            s=40,
            ax=a1,
        )
        titles, lines = [], []
        for f, g in mp.groupby("fraction"):
            r = res.get((model, f))
            titles.append(mass_title(r, f))
            u = g[g["used"].astype(bool)]
            if r is not None and r.get("r") is not None and u[mass].nunique() > 1:
                lines.append((f, *np.polyfit(u[mass], u["dppl_pct"], 1)))
        for _, slope, icpt in lines:
            xs = np.linspace(0, used[mass].max() * 1.05, 20)
            a1.plot(xs, slope * xs + icpt, "--", color="grey", lw=0.8)
        where = f"{model}: " if model else ""
        a1.set_title(f"{where}points of r: {'; '.join(titles)}", fontsize=8)
        a1.set_xlabel("mean substituted gate mass per token-layer")
        a1.set_ylabel(f"Δppl % vs {fd.out.baseline}")
        legend_below(a1, 3)
        everything = mp.assign(group=np.where(mp["used"].astype(bool), "point of r", mp["group"]))
        sns.scatterplot(data=everything, x=mass, y="dppl_pct", hue="group", s=40, ax=a2)
        for _, slope, icpt in lines:
            xs = np.linspace(0, mp[mass].max() * 1.05, 20)
            a2.plot(xs, slope * xs + icpt, "--", color="grey", lw=0.8)
        symlog_if_wide(a2, mp["dppl_pct"])
        a2.set_title(
            f"{where}every emulated policy; dashed: the line of the points of r", fontsize=8
        )
        a2.set_xlabel("mean substituted gate mass per token-layer")
        a2.set_ylabel("Δppl %")
        legend_below(a2, 2)
        labelled += [
            (a1, used, mass, "dppl_pct"),
            (a2, mp[~mp["used"].astype(bool)], mass, "dppl_pct"),
        ]
    return finish(fig, fd, labelled)


def fig_expb(fd: FigureData) -> plt.Figure:
    """Per model: realized masses per design and condition; then per design its effect with
    its CI by target, on that design's own scale (an invalid target is marked and does not set
    the scale when a valid one exists)."""
    expb = fd.table("expb")
    lo, hi = column(expb, "effect_ci_lo", "ci_lo"), column(expb, "effect_ci_hi", "ci_hi")
    models = fd.models(expb)
    designs = sorted(expb["design"].unique())
    fig, axes = panels(len(models), 1 + len(designs), width=4.6)
    for row, model in zip(axes, models, strict=True):
        a1 = row[0]
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
        legend_below(a1, 2)
        for j, (ax, design) in enumerate(zip(row[1:], designs, strict=True)):
            d = g[g["design"] == design]
            if d.empty:
                ax.set_title(f"{where}{design} design: not run", fontsize=8)
                continue
            effect_panel(ax, d, lo, hi, f"C{j}")
            label = d["effect_label"].iloc[0] if "effect_label" in d and len(d) else "effect"
            ax.set_ylabel(f"{label} ({fd.ci})")
            ax.set_title(f"{where}{design} design: heavy − light by target", fontsize=8)
    fig.tight_layout()
    return fig


def effect_panel(ax: plt.Axes, d, lo: str | None, hi: str | None, color: str) -> None:
    """One design's effects with their intervals; invalid targets as red x, left out of the
    scale when a valid target exists (a note says where they are)."""
    targets = d["target_mass"].to_numpy(float)
    x = np.arange(len(d))
    y = d["effect"].to_numpy(float)
    valid = d["valid"].astype(bool).to_numpy()
    if lo:
        err = np.vstack([y - d[lo].to_numpy(float), d[hi].to_numpy(float) - y])
        err = np.abs(np.nan_to_num(err))
        ax.errorbar(x[valid], y[valid], yerr=err[:, valid], fmt="o", color=color, capsize=3)
    else:
        ax.plot(x[valid], y[valid], "o", color=color)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{t:g}" for t in targets])
    ax.set_xlabel("target m* per token-layer (red x: invalid)")
    off = []
    if valid.any():
        ax.autoscale(axis="y")
        bottom, top = ax.get_ylim()
        for xi, yi in zip(x[~valid], y[~valid], strict=True):
            if np.isfinite(yi) and bottom <= yi <= top:
                ax.plot(xi, yi, "x", color="red", ms=9)
            elif np.isfinite(yi):
                off.append(f"{targets[xi]:g}: {yi:+.3g}")
    else:
        ax.plot(x, y, "x", color="red", ms=9)
    note = "invalid, off this scale: " + ", ".join(off) if off else ""
    if not valid.any():
        note = "invalid at every target: not a result"
    if note:  # at the bottom, clear of the markers near the top
        ax.text(0.02, 0.02, note, transform=ax.transAxes, va="bottom", fontsize=7, color="red")


def fig_admission(fd: FigureData) -> plt.Figure:
    """Per model: ΔNLL vs the exact twin by bin, after a topic change (solid) and in each
    stream's first document (dashed); the boundary token is its own bin; legend beside."""
    adm = fd.table("admission")
    if "segment" not in adm.columns:
        adm = adm.assign(segment="after_change")
    order = adm.sort_values("bin").drop_duplicates("bin_label")["bin_label"].tolist()
    pos = {lab: i for i, lab in enumerate(order)}
    models = fd.models(adm)
    fig, axes = panels(len(models), 1, width=7.0)
    for ax, model in zip(axes[:, 0], models, strict=True):
        g_m = rows_of(adm, model)
        pairs = unique(zip(g_m["policy"], g_m["twin"], g_m["fraction"], strict=True))
        for i, (name, twin, frac) in enumerate(pairs):
            for seg, (style, words) in SEGMENT_STYLE.items():
                g = g_m[
                    (g_m["policy"] == name)
                    & (g_m["twin"] == twin)
                    & (g_m["fraction"] == frac)
                    & (g_m["segment"] == seg)
                ].sort_values("bin")
                if g.empty:
                    continue
                x = g["bin_label"].map(pos).to_numpy(float) + (0.08 if seg != "after_change" else 0)
                label = f"{name} vs {twin} (f={frac:g}), {words}"
                ax.plot(x, g["dnll_mean"], marker="o", ls=style, color=f"C{i}", label=label)
                ax.fill_between(
                    x, g["ci_lo"].astype(float), g["ci_hi"].astype(float), color=f"C{i}", alpha=0.12
                )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(range(len(order)), order, rotation=45, fontsize=7)
        ax.set_xlabel("tokens since the document's first token (boundary: the first token)")
        ax.set_ylabel("ΔNLL per token, admission − exact twin")
        where = f"{model}: " if model else ""
        ax.set_title(
            f"{where}admission gain ({fd.ci} over streams; below 0: admission helps)", fontsize=8
        )
    fig.tight_layout()  # before the legends: outside the axes, they must not shrink them
    for ax in axes[:, 0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig
