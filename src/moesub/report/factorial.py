"""Experiment B's factorial design in the report (rank bucket x weight band, `moesub.stats.
expb_factorial`): what the plan reached, one line per pre-registered test (its adjusted p and
direction from `tests.parquet`), the headline's sentence, the tests and cells tables, and the
figure."""

from __future__ import annotations

from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moesub.config import FACTORIAL_CELLS as CELLS  # noqa: E402
from moesub.report.claims import statement, test_of, test_words  # noqa: E402
from moesub.report.load import AnalysisOutputs, ci_label, finite  # noqa: E402
from moesub.report.plotting import FigureData, panels, rows_of  # noqa: E402
from moesub.report.tables import Col, Row, Table, interval, make_table, num, pct, text  # noqa: E402

RANKS = {"low": "low rank", "high": "high rank"}
AGAINST = "evidence against the hypothesis"  # a direction of `tests.parquet`


def _cell_label(cell: dict[str, Any]) -> str:
    """ "low rank (3), light [0.07, 0.09)" from a cells row."""
    ranks, band = str(cell["cell"]).split("_")
    r = cell.get("ranks")
    where = "" if r is None else f" ({r[0]})" if r[0] == r[1] else f" ({r[0]}-{r[1]})"
    b = cell.get("band")
    weights = "" if b is None else f" [{b[0]:g}, {b[1]:g})"
    return f"{RANKS[ranks]}{where}, {band}{weights}"


def _estimate(t: Row, fmt: str = "{:+.2g}", kind: str = "t_") -> str:
    """The estimate with its t interval (the one its t-test inverts; `kind` "": the stream
    bootstrap's)."""
    iv = interval(t.get(f"estimate_{kind}ci_lo"), t.get(f"estimate_{kind}ci_hi"), fmt)
    return f"{num(t.get('estimate'), fmt)} {iv}"


def _adjusted(out: AnalysisOutputs, model: str | None, t: Row) -> Row:
    """The test's row of `tests.parquet` (adjusted p, direction), or an empty row."""
    return test_of(out, model, name=t.get("name"))


def _which_rank(t: Row, adjusted: Row) -> str:
    """Which rank costs more, where a rank test finds that the rank matters."""
    if t.get("expected") != 0 or adjusted.get("direction") != AGAINST:
        return ""
    return f" (the high rank costs {'more' if float(t['estimate']) > 0 else 'less'})"


def estimate_lines(out: AnalysisOutputs, r: Row) -> list[str]:
    """One model's pre-registered tests: estimate, t interval, adjusted and raw p, direction."""
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    lines = []
    for t in r.get("tests") or []:
        if t.get("family") != "pre-registered":
            continue
        adjusted = _adjusted(out, r.get("model"), t)
        lines.append(
            f"{t['label']}: {_estimate(t)} ({ci}, t over {t.get('n_streams')} streams) "
            f"{r.get('unit')}, {test_words(adjusted, alpha, '{:.2g}')}" + _which_rank(t, adjusted)
        )
    return lines


def factorial_headline(out: AnalysisOutputs) -> list[str]:
    """Per model, one sentence: the weight at a fixed rank and the rank at a fixed weight."""
    return [
        f"{r.get('model') or 'model'}: Experiment B, factorial design: "
        + "; ".join(estimate_lines(out, r))
        + "."
        for r in out.doc.get("expb_factorial") or []
        if r.get("tests")
    ]


def factorial_lines(out: AnalysisOutputs) -> list[str]:
    """Per model: what the plan reached (calibration and evaluation), then one line per
    pre-registered test with its estimate, interval, adjusted and raw p and direction."""
    lines = []
    for r in out.doc.get("expb_factorial") or []:
        model = r.get("model") or "model"
        plan, cal = r.get("plan") or {}, r.get("calibration") or {}
        support = ", ".join(f"{c} {pct((cal.get('support') or {}).get(c), 2)}" for c in CELLS)
        contrasts = [t["test"] for t in r.get("tests") or [] if t["test"] in plan.get("shared", {})]
        shared = ", ".join(f"{c} {pct(plan['shared'][c], 0)}" for c in contrasts)
        lines.append(
            f"{model}: feasibility on the calibration capture: token-layers supporting each cell "
            f"{support}; supporting all four cells {pct(cal.get('all_cells'), 2)}; reachable "
            f"share per cell {pct(cal.get('max_share'), 2)}. Evaluation plan: "
            f"{plan.get('count', '—')} token-layers per cell ({pct(plan.get('realized_share'), 2)} "
            f"of {plan.get('token_layers', '—')}), the same count in every (stream, layer); "
            f"token-layers each contrast's two cells share: {shared}."
        )
        lines += [f"{model}: {line}." for line in estimate_lines(out, r)]
        primary = [t for t in r.get("tests") or [] if t.get("family") == "pre-registered"]
        lines += _power_line(model, primary, r.get("cells") or [])
    return lines


def _power_line(model: str, tests: list[Row], cells: list[Row]) -> list[str]:
    """A sentence when the smallest MDE of the pre-registered tests exceeds every cell's own
    ΔNLL per substitution: then no effect detected cannot tell the rank from the weight."""
    mdes = [float(t["mde"]) for t in tests if finite(t.get("mde"))]
    levels = [abs(float(c["dnll_per_sub"])) for c in cells if finite(c.get("dnll_per_sub"))]
    if not mdes or not levels or min(mdes) <= max(levels):
        return []
    return [
        f"{model}: power: the tests detect effects of {min(mdes):.2g} or more; every cell's own "
        f"ΔNLL per substituted token-layer is smaller (at most {max(levels):.2g} in size), so "
        '"no detectable effect" here cannot tell the rank from the weight.'
    ]


def factorial_tests_table(out: AnalysisOutputs) -> Table:
    """One row per (model, test): the estimate with its t and bootstrap intervals, raw and
    adjusted p, direction, MDE and how balanced its two sides are."""
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))

    def adjusted(r: Row) -> Row:
        return _adjusted(out, r.get("model"), r)

    def direction(r: Row) -> str:
        a = adjusted(r)
        return statement(a, alpha, "{:.2g}") + _which_rank(r, a)

    def sides(key: str, fmt: str) -> Col:
        def cell(r: Row) -> str:
            return f"{num(r.get(f'{key}_other'), fmt)} vs {num(r.get(f'{key}_reference'), fmt)}"

        return Col(f"{key}: other vs reference side", cell)

    cols = [
        Col("model", text("model"), False),
        Col("test (family)", lambda r: f"{r.get('name')} ({r.get('family')})", False),
        Col("contrast; predicted", lambda r: f"{r.get('label')}; {r.get('predicted')}", False),
        Col(f"estimate, ΔNLL per substituted token-layer [t {ci}]", _estimate),
        Col(f"stream bootstrap [{ci}] (sensitivity)", lambda r: _estimate(r, kind="")),
        Col("p (raw, two-sided t)", lambda r: num(r.get("p_value"), "{:.2g}")),
        Col(
            "p adjusted (pre-registered: Holm; exploratory: BH)",
            lambda r: num(adjusted(r).get("p_adjusted"), "{:.2g}"),
        ),
        Col("direction", direction, False),
        Col("MDE (normal approx.)", lambda r: num(r.get("mde"), "{:.2g}")),
        sides("weight", "{:.4f}"),
        sides("rank", "{:.2f}"),
        Col("shared token-layers", lambda r: pct(r.get("shared"), 0)),
    ]
    df = out.table("expb_factorial")
    return make_table("expb-factorial", df.to_dict("records") if not df.empty else [], cols)


def factorial_cells_table(out: AnalysisOutputs) -> Table:
    """One row per (model, cell): counts, realized weight and rank, ΔNLL per substitution."""
    ci = ci_label(out.ci_level)
    cols = [
        Col("model", text("model"), False),
        Col("cell", _cell_label, False),
        Col("substituted (planned)", lambda r: f"{r.get('substituted')} ({r.get('planned')})"),
        Col("support (evaluation)", lambda r: pct(r.get("support"), 2)),
        Col("mean gate weight", lambda r: num(r.get("mean_weight"), "{:.4f}")),
        Col("mean rank", lambda r: num(r.get("mean_rank"), "{:.2f}")),
        Col(
            f"ΔNLL per substituted token-layer [{ci}]",
            lambda r: (
                f"{num(r.get('dnll_per_sub'), '{:+.2g}')} "
                f"{interval(r.get('dnll_per_sub_ci_lo'), r.get('dnll_per_sub_ci_hi'), '{:+.2g}')}"
            ),
        ),
        Col("ΔNLL per token", lambda r: num(r.get("dnll_per_token"), "{:+.2g}")),
    ]
    df = out.table("expb_factorial_cells")
    return make_table("expb-factorial-cells", df.to_dict("records") if not df.empty else [], cols)


def fig_factorial(fd: FigureData) -> plt.Figure:
    """Per model: each cell's ΔNLL per substituted token-layer against its realized weight (one
    line per rank bucket), and every test's estimate with its t interval (shaded: ± its MDE)."""
    cells, tests = fd.out.table("expb_factorial_cells"), fd.out.table("expb_factorial")
    models = fd.models(cells)
    fig, axes = panels(len(models), 2)
    for (a1, a2), model in zip(axes, models, strict=True):
        c = rows_of(cells, model).set_index("cell")
        where = f"{model}: " if model else ""
        for j, bucket in enumerate(("low", "high")):
            rows = c.loc[[f"{bucket}_light", f"{bucket}_heavy"]]
            x, y = rows["mean_weight"].to_numpy(float), rows["dnll_per_sub"].to_numpy(float)
            err = np.abs(
                np.vstack([y - rows["dnll_per_sub_ci_lo"], rows["dnll_per_sub_ci_hi"] - y])
            )
            label = f"{RANKS[bucket]} (mean rank {rows['mean_rank'].mean():.1f})"
            a1.errorbar(x, y, yerr=err, fmt="o-", capsize=3, color=f"C{j}", label=label)
        a1.axhline(0, color="black", lw=0.8)
        a1.set_xlabel("realized mean gate weight of the substituted expert")
        a1.set_ylabel(f"ΔNLL per substituted token-layer ({fd.ci})")
        a1.set_title(f"{where}cells: light and heavy band per rank bucket", fontsize=8)
        a1.legend(fontsize=7, loc="best")
        t = rows_of(tests, model).reset_index(drop=True)
        ys = np.arange(len(t))[::-1]
        est = t["estimate"].to_numpy(float)
        lo, hi = t["estimate_t_ci_lo"].to_numpy(float), t["estimate_t_ci_hi"].to_numpy(float)
        for y, e, l_, h, m, valid in zip(ys, est, lo, hi, t["mde"], t["valid"], strict=True):
            if finite(m):
                a2.fill_betweenx([y - 0.3, y + 0.3], -m, m, color="0.9", lw=0)
            a2.errorbar(e, y, xerr=[[e - l_], [h - e]], fmt="o" if valid else "x", capsize=3,
                        color="C0" if valid else "red")  # fmt: skip
        a2.axvline(0, color="black", lw=0.8)
        a2.set_yticks(ys, [str(n) for n in t["test"]], fontsize=7)
        a2.set_xlabel(f"ΔNLL per substituted token-layer (t {fd.ci}; grey: ± MDE; red x: invalid)")
        a2.set_title(f"{where}weight at a fixed rank, rank at a fixed weight", fontsize=8)
    fig.tight_layout()
    return fig
