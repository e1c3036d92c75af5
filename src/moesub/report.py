"""`results/report.html`: one self-contained HTML file from the analysis directory.

`render_report(analysis_dir, inputs, params, out_html)` reads what `moesub.stats.run_analysis`
wrote (through DuckDB), draws the seaborn figures (Agg backend), writes each as a PNG under
`<out_html's folder>/figures/` (for Snakemake's `report()` tags) and embeds the same bytes as
base64 in the page, then renders `templates/report.html.j2` (Jinja2, autoescaped). No external
CSS, JS, fonts or images: the file opens offline. A part whose inputs were missing shows the
reason `run_analysis` recorded instead of its figure.
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import json
import math
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import jinja2
import matplotlib
import numpy as np
import pandas as pd
import pyarrow.parquet as pq

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from moesub.io import atomic_path  # noqa: E402
from moesub.stats import OUTPUT_FILES  # noqa: E402

TEMPLATE_DIR = Path(__file__).parent / "templates"
TEMPLATE = "report.html.j2"
DPI = 110


@dataclass
class Figure:
    """One figure of the report: its id, caption, PNG path and inline data URI."""

    name: str
    title: str
    caption: str
    png: Path | None = None
    data_uri: str | None = None
    missing: str | None = None


# ----------------------------------------------------------------------------------------------
# loading


def load_table(path: Path) -> pd.DataFrame:
    """A Parquet file of the analysis through DuckDB; empty frame if absent or column-less."""
    if not path.is_file() or len(pq.read_schema(path)) == 0:
        return pd.DataFrame()
    con = duckdb.connect()
    try:
        return con.execute("SELECT * FROM read_parquet(?)", [str(path)]).df()
    finally:
        con.close()


def machine_info() -> dict[str, Any]:
    """Where the report was rendered (the analysis machine); engine devices come from the data."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    for pkg in ("moesub", "torch", "transformers", "duckdb", "scipy", "seaborn"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = "not installed"
    return info


def _read_json_files(paths: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        try:
            out.append({"path": str(p), "content": json.loads(Path(p).read_text())})
        except (OSError, ValueError) as exc:
            out.append({"path": str(p), "content": {"error": f"unreadable: {exc}"}})
    return out


# ----------------------------------------------------------------------------------------------
# figures


def _fig_to_png(fig: plt.Figure, path: Path) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    data = buf.getvalue()
    with atomic_path(path, suffix=".png") as tmp:
        tmp.write_bytes(data)
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _fmt_ci(lo: Any, hi: Any, digits: int = 3) -> str:
    if lo is None or hi is None or _isnan(lo) or _isnan(hi):
        return "CI n/a"
    return f"[{lo:.{digits}g}, {hi:.{digits}g}]"


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _label(df: pd.DataFrame, d: dict) -> pd.Series:
    """Point labels: the policy, prefixed by the model when the analysis holds several."""
    if d.get("multi") and "model" in df.columns:
        return df["model"].astype(str) + "/" + df["policy"].astype(str)
    return df["policy"].astype(str)


def _annotate(ax: plt.Axes, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str]):
    for x, y, t in zip(xs, ys, labels, strict=True):
        if np.isfinite(x) and np.isfinite(y):
            ax.annotate(t, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)


def fig_mass(d: dict) -> plt.Figure:
    pts: pd.DataFrame = d["mass_points"]
    res = {
        (r.get("model", ""), r["fraction"], r["group"]): r
        for r in d["analysis"].get("mass_hypothesis", [])
    }
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    first = pts[pts["group"] == "fetches first choice"]
    sns.scatterplot(
        data=first, x="mass_mean", y="dppl_pct", hue="fraction", s=60, ax=a1, palette="deep"
    )
    _annotate(a1, first["mass_mean"], first["dppl_pct"], _label(first, d))
    for _, g in first.groupby("fraction"):
        if len(g) >= 2 and g["mass_mean"].nunique() > 1:
            slope, icpt = np.polyfit(g["mass_mean"], g["dppl_pct"], 1)
            xs = np.linspace(0, g["mass_mean"].max() * 1.05, 20)
            a1.plot(xs, slope * xs + icpt, "--", color="grey", lw=0.8)
    lines = []
    for (model, frac, group), r in sorted(res.items()):
        where = f"{model} " if d.get("multi") else ""
        if r.get("r") is None:
            lines.append(f"{where}f={frac:g} {group}: r {r.get('reason')}, n = {r['n']}")
        else:
            lines.append(
                f"{where}f={frac:g} {group}: r = {r['r']:.3f} "
                f"{_fmt_ci(r.get('ci_lo'), r.get('ci_hi'))}, n = {r['n']}"
            )
    a1.set_title("policies that always fetch the first choice", fontsize=9)
    a1.set_xlabel("mean substituted gate mass per token")
    a1.set_ylabel("Δppl % vs fetch_every_miss")
    sns.scatterplot(data=pts, x="mass_mean", y="dppl_pct", hue="group", s=60, ax=a2)
    _annotate(a2, pts["mass_mean"], pts["dppl_pct"], _label(pts, d))
    if pts["dppl_pct"].max() > 50:
        a2.set_yscale("symlog", linthresh=1.0)
        a2.set_ylim(bottom=min(0.0, float(pts["dppl_pct"].min())))
    a2.set_title("all substituting policies", fontsize=9)
    a2.set_xlabel("mean substituted gate mass per token")
    a2.set_ylabel("Δppl %")
    a2.legend(fontsize=7)
    fig.suptitle("\n".join(lines), fontsize=8)
    fig.tight_layout()
    return fig


def fig_speed(d: dict) -> plt.Figure:
    sq: pd.DataFrame = d["speed_quality"]
    src = "engine" if (sq["source"] == "engine").any() else "simulate"
    sq = sq[sq["source"] == src].copy()
    sq["ms_per_token"] = 1e3 * sq["time_per_token_s"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sns.scatterplot(
        data=sq, x="ms_per_token", y="dppl_pct", hue="device", style="frontier", s=60, ax=ax
    )
    yerr = np.vstack([sq["dppl_pct"] - sq["dppl_ci_lo"], sq["dppl_ci_hi"] - sq["dppl_pct"]])
    ax.errorbar(
        sq["ms_per_token"],
        sq["dppl_pct"],
        yerr=np.nan_to_num(np.abs(yerr)),
        fmt="none",
        ecolor="grey",
        elinewidth=0.8,
    )
    keys = ["model", "fraction", "device"] if "model" in sq.columns else ["fraction", "device"]
    for _, g in sq[sq["frontier"]].groupby(keys):
        g = g.sort_values("ms_per_token")
        ax.plot(g["ms_per_token"], g["dppl_pct"], "--", color="black", lw=0.8)
    _annotate(ax, sq["ms_per_token"], sq["dppl_pct"], _label(sq, d))
    ax.set_xlabel(f"time per token, ms ({src})")
    ax.set_ylabel("Δppl % (95% CI over streams)")
    if sq["dppl_pct"].max() > 50:
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title(f"speed/quality; dashed: Pareto frontier; n = {len(sq)} runs", fontsize=9)
    return fig


def fig_admission(d: dict) -> plt.Figure:
    adm: pd.DataFrame = d["admission"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    order = adm.drop_duplicates("bin").sort_values("bin")["bin_label"].tolist()
    pos = {lab: i for i, lab in enumerate(order)}
    adm = adm.assign(label=_label(adm, d))
    for (name, twin, frac), g in adm.groupby(["label", "twin", "fraction"]):
        g = g.sort_values("bin")
        x = g["bin_label"].map(pos)
        ax.plot(x, g["dnll_mean"], marker="o", label=f"{name} vs {twin} (f={frac:g})")
        ax.fill_between(x, g["ci_lo"].astype(float), g["ci_hi"].astype(float), alpha=0.2)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(order)), order, rotation=45, fontsize=7)
    ax.set_xlabel("tokens since the last document start (topic change)")
    ax.set_ylabel("ΔNLL per token, admission − twin")
    ax.legend(fontsize=7)
    ax.set_title(
        f"admission gain (95% CI over streams; tokens per bin {int(adm['n_tokens'].min())}"
        f"–{int(adm['n_tokens'].max())})",
        fontsize=9,
    )
    return fig


def fig_expb(d: dict) -> plt.Figure:
    expb = d["analysis"]["expb"][0]  # the first model's (the template lists every model's)
    streams: pd.DataFrame = d["expb"]
    if "model" in streams.columns:
        streams = streams[streams["model"] == expb.get("model", "")]
    targets = expb["targets"]
    decision = expb["decision"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4.2))
    rows = [
        {"target": f"{t['target_mass']:g}", "condition": c, "realized": t.get(f"realized_{c}")}
        for t in targets
        for c in ("heavy", "light")
        if t.get(f"realized_{c}") is not None
    ]
    if rows:
        sns.barplot(data=pd.DataFrame(rows), x="target", y="realized", hue="condition", ax=a1)
    rule = decision.get("rule", {})
    if rule:
        m_star = rule["primary"]
        a1.axhline(m_star, color="black", ls="--", lw=0.8, label="m*")
        a1.axhline(
            rule["min_heavy_fraction"] * m_star,
            color="red",
            ls=":",
            lw=0.8,
            label="validity: heavy >= this",
        )
    a1.set_xlabel("target mass")
    a1.set_ylabel("realized mean mass per token")
    a1.legend(fontsize=7)
    prim = (
        streams[np.isclose(streams["target_mass"], decision["target_mass"])]
        if len(streams)
        else streams
    )
    if len(prim):
        sns.stripplot(data=prim, y="d_per_mass", ax=a2, size=6, color="C2")
        a2.axhline(0, color="black", lw=0.8)
    a2.set_ylabel("ΔNLL/mass heavy − ΔNLL/mass light, per stream")
    a2.set_title(f"primary m* = {decision['target_mass']:g}; n = {len(prim)} streams", fontsize=9)
    fig.suptitle(f"Experiment B outcome: {decision.get('outcome', 'n/a')}", fontsize=9)
    fig.tight_layout()
    return fig


def fig_layers(d: dict) -> plt.Figure:
    lay: pd.DataFrame = d["layer_hit_rates"]
    lay = lay.assign(label=_label(lay, d))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sns.lineplot(
        data=lay, x="layer", y="hit_rate", hue="label", style="fraction", marker="o", ax=ax
    )
    ax.set_ylabel("hit rate (simulated)")
    ax.set_title(f"per-layer hit rates; {int(lay['tokens'].max())} tokens per run", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return fig


def fig_sim_engine(d: dict) -> plt.Figure:
    se: pd.DataFrame = d["sim_vs_engine"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    x, y = 1e3 * se["time_mean_s"], 1e3 * se["est_time_per_token_s"]
    sns.scatterplot(x=x, y=y, hue=se["device"], ax=ax, s=60)
    _annotate(ax, x, y, _label(se, d))
    lim = [0, 1.1 * float(max(x.max(), y.max()))]
    ax.plot(lim, lim, "--", color="grey", lw=0.8)
    ax.set_xlabel("engine mean time per token, ms")
    ax.set_ylabel("simulator estimate, ms")
    med = float(se["rel_error"].abs().median()) if len(se) else None
    ax.set_title(
        f"n = {len(se)}; median |relative error| = {'n/a' if med is None else f'{100 * med:.1f}%'}",
        fontsize=9,
    )
    return fig


def fig_generation(d: dict) -> plt.Figure:
    gen: pd.DataFrame = d["generation"]
    tasks = sorted(gen["task"].unique())
    fig, axes = plt.subplots(
        1, len(tasks), figsize=(4.5 * len(tasks), 4.2), squeeze=False, sharey=True
    )
    for ax, task in zip(axes[0], tasks, strict=True):
        g = gen[gen["task"] == task].sort_values([c for c in ("model", "policy") if c in gen])
        lab = [
            f"{p} (f={f:g})" if gen["fraction"].nunique() > 1 else p
            for p, f in zip(_label(g, d), g["fraction"], strict=True)
        ]
        err = np.vstack([g["accuracy"] - g["acc_ci_lo"], g["acc_ci_hi"] - g["accuracy"]])
        ax.barh(lab, g["accuracy"], xerr=np.abs(err), color="C0", alpha=0.8)
        ax.plot(g["agree_exact"], lab, "o", color="C3", label="exact agreement")
        ax.set_xlim(0, 1)
        ax.set_xlabel("accuracy / pass@1 (95% Wilson CI)")
        ax.set_title(f"{task}: n = {int(g['n'].min())}–{int(g['n'].max())} problems", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def fig_per_input(d: dict) -> plt.Figure:
    pts: pd.DataFrame = d["per_input_points"]
    pts = pts[(pts["level"] == "stream") & (pts["policy"] != d["baseline"])]
    pts = pts.assign(label=_label(pts, d))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sns.scatterplot(data=pts, x="mass_mean", y="dnll_mean", hue="label", ax=ax, s=25)
    ax.set_xlabel("per-stream mean mass")
    ax.set_ylabel("per-stream mean ΔNLL vs fetch_every_miss")
    ax.set_title(
        f"per input (stream level); n = {pts['unit'].nunique()} streams per policy", fontsize=9
    )
    ax.legend(fontsize=7, ncol=2)
    return fig


FIGURES: list[tuple[str, str, str, str, Callable[[dict], plt.Figure]]] = [
    # (name, title, table it needs, caption, draw)
    (
        "mass_vs_dppl",
        "Mass hypothesis",
        "mass_points",
        "Mean substituted gate mass vs perplexity increase across policies; r with a bootstrap CI "
        "over streams.",
        fig_mass,
    ),
    (
        "speed_quality",
        "Speed / quality frontier",
        "speed_quality",
        "Time per token vs Δppl %; the dashed line joins the Pareto-optimal policies.",
        fig_speed,
    ),
    (
        "admission",
        "Admission gain vs tokens since topic change",
        "admission",
        "ΔNLL of each admission policy minus its no-admission twin, binned by tokens since the "
        "last document boundary.",
        fig_admission,
    ),
    (
        "expb",
        "Experiment B",
        "expb",
        "Realized mass per condition, and the paired per-stream statistic at the primary target.",
        fig_expb,
    ),
    (
        "layer_hit_rates",
        "Per-layer hit rates",
        "layer_hit_rates",
        "Simulated hit rate of each MoE layer's cache.",
        fig_layers,
    ),
    (
        "sim_vs_engine",
        "Simulator vs engine time",
        "sim_vs_engine",
        "The cost model's estimated time per token against the engine's measured mean.",
        fig_sim_engine,
    ),
    (
        "generation",
        "Generation",
        "generation",
        "GSM8K exact-match accuracy and HumanEval pass@1 with Wilson CIs; dots: exact agreement "
        "with fetch_every_miss.",
        fig_generation,
    ),
    (
        "per_input",
        "Per-input mass vs ΔNLL",
        "per_input_points",
        "Per stream, within each policy: does a stream's mass predict its quality loss?",
        fig_per_input,
    ),
]
PART_OF_TABLE = {
    "mass_points": "mass_hypothesis",
    "speed_quality": "speed_quality",
    "admission": "admission",
    "expb": "expb",
    "layer_hit_rates": "simulate",
    "sim_vs_engine": "sim_vs_engine",
    "generation": "generation",
    "per_input_points": "per_input",
}


def draw_figures(d: dict, fig_dir: Path) -> list[Figure]:
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.8)
    out = []
    for name, title, table, caption, draw in FIGURES:
        f = Figure(name=name, title=title, caption=caption)
        part = d["analysis"]["parts"].get(PART_OF_TABLE[table], {})
        if d[table].empty:
            f.missing = part.get("reason") or f"no data ({table} is empty)"
        else:
            f.png = fig_dir / f"{name}.png"
            f.data_uri = _fig_to_png(draw(d), f.png)
        out.append(f)
    return out


# ----------------------------------------------------------------------------------------------
# tables for the template


def _cell(v: Any, fmt: str = "{:.3g}") -> str:
    if v is None or _isnan(v) or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, (float, np.floating)):
        return fmt.format(float(v))
    return str(v)


def summary_rows(summary: pd.DataFrame) -> list[dict[str, str]]:
    rows = []
    for r in summary.to_dict("records"):

        def g(k, r=r):
            return r.get(k)

        def task(t, r=r):
            acc = r.get(f"{t}_accuracy")
            if acc is None or _isnan(acc):
                return "—"
            return (
                f"{100 * acc:.1f}% {_fmt_ci(100 * r[f'{t}_acc_ci_lo'], 100 * r[f'{t}_acc_ci_hi'])}"
                f" n={int(r[f'{t}_n'])}"
            )

        tpt = g("time_per_token_s")
        rows.append(
            {
                "model": str(r.get("model", "")),
                "policy": r["policy"],
                "fraction": _cell(g("fraction"), "{:g}"),
                "rule": _cell(g("rule"))
                + (f" τ={g('tau'):g}" if g("rule") == "threshold" else "")
                + (f" β={g('beta'):g}" if (g("beta") or 0) > 0 else "")
                + (f" {g('eviction')}" if isinstance(g("eviction"), str) else ""),
                "sub_rate": _cell(
                    g("sub_rate") * 100
                    if g("sub_rate") is not None and not _isnan(g("sub_rate"))
                    else None,
                    "{:.2f}%",
                ),
                "mass": _cell(g("mass_mean"), "{:.4g}"),
                "dppl": (
                    _cell(g("dppl_pct"), "{:+.2f}%")
                    + " "
                    + (
                        _fmt_ci(g("dppl_ci_lo"), g("dppl_ci_hi"))
                        if g("dppl_pct") is not None and not _isnan(g("dppl_pct"))
                        else ""
                    )
                ).strip(),
                "time": (
                    _cell(tpt * 1e3 if tpt is not None and not _isnan(tpt) else None, "{:.3g}")
                    + (f" ({g('engine_device')})" if isinstance(g("engine_device"), str) else "")
                ),
                "sim_time": _cell(
                    g("sim_time_per_token_s") * 1e3
                    if g("sim_time_per_token_s") is not None
                    and not _isnan(g("sim_time_per_token_s"))
                    else None,
                    "{:.3g}",
                ),
                "speedup": _cell(g("speedup_vs_fetch_every_miss"), "{:.2f}×"),
                "speedup_host": _cell(g("speedup_vs_host_compute"), "{:.2f}×"),
                "gsm8k": task("gsm8k"),
                "humaneval": task("humaneval"),
            }
        )
    return rows


def records(df: pd.DataFrame, cols: Sequence[str] | None = None) -> list[dict[str, str]]:
    if df.empty:
        return []
    df = df[list(cols)] if cols else df
    return [{k: _cell(v, "{:.4g}") for k, v in r.items()} for r in df.to_dict("records")]


def headline(d: dict) -> list[str]:
    """The report's headline numbers, as sentences."""
    a = d["analysis"]
    out = []
    for r in a.get("mass_hypothesis", []):
        if r.get("r") is not None:
            out.append(
                f"Mass hypothesis ({r['group']}, fraction {r['fraction']:g}): Pearson r = "
                f"{r['r']:.3f}, {int(100 * d['ci_level'])}% bootstrap CI "
                f"{_fmt_ci(r.get('ci_lo'), r.get('ci_hi'))}, n = {r['n']} policies."
            )
        else:
            out.append(
                f"Mass hypothesis ({r['group']}, fraction {r['fraction']:g}): "
                f"{r.get('reason')}; n = {r['n']}."
            )
    multi = d.get("multi")
    for e in a.get("expb") or []:
        where = f" ({e['model']})" if multi else ""
        out.append(f"Experiment B{where}: {e['decision']['outcome_text']}")
    s = d["summary"]
    if not s.empty:
        for name in ("quality", "speed", "rule_015", "substitute_all"):
            for r in s[s["policy"] == name].to_dict("records"):
                bits = []
                if r.get("dppl_pct") is not None and not _isnan(r.get("dppl_pct")):
                    bits.append(
                        f"Δppl {r['dppl_pct']:+.2f}% "
                        f"{_fmt_ci(r.get('dppl_ci_lo'), r.get('dppl_ci_hi'))}"
                    )
                sp = r.get("speedup_vs_fetch_every_miss")
                if sp is not None and not _isnan(sp):
                    bits.append(f"{sp:.2f}× faster than fetch_every_miss")
                sh = r.get("speedup_vs_host_compute")
                if sh is not None and not _isnan(sh):
                    bits.append(f"{sh:.2f}× vs host_compute")
                if bits:
                    where = f"{r['model']}/" if multi else ""
                    out.append(
                        f"{where}{name} (fraction {r['fraction']:g}): " + ", ".join(bits) + "."
                    )
    for r in a.get("admission", []):
        if r.get("dppl_pct_vs_twin") is not None:
            out.append(
                f"Admission: {r['policy']} vs {r['twin']} Δppl "
                f"{r['dppl_pct_vs_twin']:+.2f}% {_fmt_ci(r.get('ci_lo'), r.get('ci_hi'))}"
                f" over {r['n_tokens']} tokens."
            )
    return out


# ----------------------------------------------------------------------------------------------
# entry point


def render_report(
    analysis_dir: str | os.PathLike,
    inputs: Mapping[str, Sequence[str | os.PathLike]] | None,
    params: Mapping[str, Any],
    out_html: str | os.PathLike,
    fig_dir: str | os.PathLike | None = None,
) -> Path:
    """Render the self-contained report; figures also go to `fig_dir` (default
    `<out_html folder>/figures`). `inputs`: the analysis inputs (its `model_summary` and
    `calibration` JSON files are shown; Parquet provenance comes from analysis.json). `params`:
    the config shown in the report (`params["machine"]`, if given, describes the machine the
    measurements ran on in addition to the rendering machine). Returns `out_html`.
    """
    adir = Path(analysis_dir)
    if not (adir / "analysis.json").is_file():
        raise FileNotFoundError(f"analysis_dir={str(adir)!r} has no analysis.json (run_analysis)")
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a mapping, got {type(params).__name__}")
    inputs = dict(inputs or {})
    for kind in ("model_summary", "calibration"):
        for p in inputs.get(kind) or []:
            if not Path(p).is_file():
                raise FileNotFoundError(f"inputs[{kind!r}]: {str(p)!r} does not exist")
    out_html = Path(out_html)
    fig_dir = Path(fig_dir) if fig_dir is not None else out_html.parent / "figures"
    analysis = json.loads((adir / "analysis.json").read_text())
    d: dict[str, Any] = {name: load_table(adir / f"{name}.parquet") for name in OUTPUT_FILES}
    d["analysis"] = analysis
    d["baseline"] = analysis.get("params", {}).get("baseline", "fetch_every_miss")
    d["ci_level"] = analysis.get("params", {}).get("ci_level", 0.95)
    d["multi"] = len(analysis.get("models", [])) > 1
    figures = draw_figures(d, fig_dir)
    prov = analysis.get("provenance", [])
    model_meta = {}
    for p in prov:
        if p["kind"] == "capture_tokens" or "num_experts" in p["metadata"]:
            model_meta.update(p["metadata"])
    build_ids = sorted(
        {
            str(p["metadata"]["core_build_id"])
            for p in prov
            if p["metadata"].get("core_build_id") is not None
        }
    )
    devices = sorted(
        {
            f"{p['metadata'].get('device')} ({p['metadata'].get('tier')})"
            for p in prov
            if p["kind"] == "engine"
        }
    )
    per_input = d["per_input"]
    model_col = ["model"] if d["multi"] else []
    ctx = {
        "title": str(params.get("title", "moesub report")),
        "multi": d["multi"],
        "headline": headline(d),
        "summary": summary_rows(d["summary"]),
        "figures": {f.name: f for f in figures},
        "parts": analysis.get("parts", {}),
        "mass": analysis.get("mass_hypothesis", []),
        "expb": analysis.get("expb"),
        "admission": analysis.get("admission", []),
        "sim_vs_engine": analysis.get("sim_vs_engine"),
        "dppl_base": analysis.get("dppl_base", {}),
        "per_input": records(
            per_input,
            [
                *model_col,
                "policy",
                "fraction",
                "level",
                "n",
                "r",
                "r_ci_lo",
                "r_ci_hi",
                "rho",
                "reason",
            ],
        )
        if len(per_input)
        else [],
        "generation": records(
            d["generation"],
            [
                *model_col,
                "task",
                "policy",
                "fraction",
                "n",
                "accuracy",
                "acc_ci_lo",
                "acc_ci_hi",
                "agree_exact",
                "agree_prefix_mean",
                "mass_agree_rho",
                "mass_agree_n",
            ],
        ),
        "engine_bench": records(d["engine_bench"]),
        "model_summaries": _read_json_files(inputs.get("model_summary") or []),
        "calibrations": _read_json_files(inputs.get("calibration") or []),
        "model_meta": model_meta,
        "machine": machine_info(),
        "run_machine": params.get("machine"),
        "devices": devices,
        "build_ids": build_ids,
        "provenance": prov,
        "config": json.dumps(params, indent=2, sort_keys=True, default=str),
        "analysis_params": json.dumps(analysis.get("params", {}), indent=2, sort_keys=True),
    }
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    html = env.get_template(TEMPLATE).render(**ctx)
    with atomic_path(out_html, suffix=".html") as tmp:
        tmp.write_text(html, encoding="utf-8")
    return out_html
