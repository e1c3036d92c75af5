"""The claim-by-claim verdict the headline opens with, and every test by family with its raw
and adjusted p-values (`analysis.json["claims"]`, `["families"]`, `tests.parquet`).

Words shared by the sections that quote a test: `p_text` (the adjusted p first, the raw one
beside it), `mde_text` (a normal-approximation sensitivity figure) and `floor_text` (the
smallest p a test can reach, said only where it keeps the test from passing its family's
first step, alpha / m: elsewhere it carries nothing).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from moesub.report.load import AnalysisOutputs, ci_label, finite
from moesub.report.tables import Col, Row, Table, interval, make_table, num, text

VERDICTS = ("reproduces", "contradicts", "cannot decide", "not measured by this run")


def claim_lines(out: AnalysisOutputs) -> list[dict[str, str]]:
    """One line per model and claim, models in the analysis' order: the verdict, what this
    run measured and what the study found."""
    rank = {m: i for i, m in enumerate(out.models)}
    rows = sorted(out.doc.get("claims") or [], key=lambda c: rank.get(str(c.get("model")), 0))
    lines = []
    for c in rows:
        details = str(c.get("details") or "")
        if c.get("context"):
            details += f" (beside it: {c['context']})"
        measured = f"this run: {details}. " if details != c["verdict"] else ""
        lines.append(
            {
                "model": str(c.get("model") or "model"),
                "label": str(c["label"]),
                "verdict": str(c["verdict"]),
                "text": f"{measured}The study: {c['study']}.",
            }
        )
    return lines


def tests_of(out: AnalysisOutputs, model: str | None = None, **match: Any) -> list[Row]:
    """The rows of `tests.parquet` (of `model`, when given) whose columns equal `match`."""
    t = out.table("tests")
    if t.empty:
        return []
    if model is not None and "model" in t.columns:
        t = t[t["model"].astype(str) == str(model)]
    for key, value in match.items():
        if key not in t.columns:
            return []
        t = t[t[key] == value]
    return t.to_dict("records")


def test_of(out: AnalysisOutputs, model: str | None = None, **match: Any) -> Row:
    """The first test `tests_of` finds, or an empty row."""
    return next(iter(tests_of(out, model, **match)), {})


def p_text(t: Row) -> str:
    """'Holm p = 0.02 (raw 0.005)'; the reason when the test has no p-value."""
    if not finite(t.get("p_value")):
        return str(t.get("reason") or "not tested")
    adjusted, raw = num(t.get("p_adjusted"), "{:.2g}"), num(t["p_value"], "{:.2g}")
    return f"{t.get('adjustment')} p = {adjusted} (raw {raw})"


def mde_text(t: Row, fmt: str = "{:.3g}") -> str:
    if not finite(t.get("mde")):
        return ""
    return f"MDE {fmt.format(abs(float(t['mde'])))}, a normal-approximation sensitivity figure"


def floor_text(t: Row, alpha: float) -> str:
    """The smallest reachable p where it keeps the test below its family's first step."""
    min_p, m = t.get("min_p"), t.get("family_size")
    if not finite(min_p) or not finite(m) or float(min_p) * max(int(m), 1) < alpha:
        return ""
    return f"smallest reachable p {float(min_p):.2g} ≥ alpha / {int(m)}, its family's first step"


def statement(t: Row, alpha: float, fmt: str = "{:.3g}") -> str:
    """The direction in words, with the MDE beside "no detectable effect" and the p floor
    where it matters."""
    words = str(t.get("direction") or "not tested")
    if words == "not tested":
        if t.get("measured") is False:  # the section of its part says why, once
            return "not measured by this run"
        return f"not tested: {t.get('reason')}" if t.get("reason") else words
    extra = [mde_text(t, fmt)] if words == "no detectable effect" else []
    extra.append(floor_text(t, alpha))
    extra = [e for e in extra if e]
    return words + (f" ({'; '.join(extra)})" if extra else "")


def test_words(t: Row, alpha: float, fmt: str = "{:.3g}") -> str:
    """'Holm p = 0.02 (raw 0.005): supports'; the statement alone for a test without a
    p-value; "" when there is no test (an analysis without a tests table)."""
    if not t:
        return ""
    if not finite(t.get("p_value")):
        return statement(t, alpha, fmt)
    return f"{p_text(t)}: {statement(t, alpha, fmt)}"


def tests_table(out: AnalysisOutputs, family: str) -> Table:
    """Every test of `family`: estimate with its two-sided interval, the t-based sensitivity
    interval, raw and adjusted p, direction, MDE."""
    df = out.table("tests")
    table_id = f"tests-{family}"
    if df.empty or "family" not in df.columns:
        return make_table(table_id, [], [])
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    df = out.by_model(df[df["family"] == family])

    def estimate(r: Row) -> str:
        est = num(r.get("estimate"), "{:+.3g}")
        iv = interval(r.get("ci_lo"), r.get("ci_hi"), "{:+.3g}")
        return f"{est} {iv}" if iv != "—" else est

    cols = [
        Col("model", text("model"), False),
        Col("test", lambda r: str(r["name"]), False),
        Col("fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("hypothesis", text("hypothesis"), False),
        Col("estimand", text("estimand"), False),
        Col(f"estimate [{ci}]", estimate),
        Col("interval method", text("ci_method"), False),
        Col(
            f"t interval [{ci}] (sensitivity)",
            lambda r: interval(r.get("t_ci_lo"), r.get("t_ci_hi"), "{:+.3g}"),
        ),
        Col("p (two-sided, raw)", lambda r: num(r.get("p_value"), "{:.2g}")),
        Col("p adjusted", lambda r: num(r.get("p_adjusted"), "{:.2g}")),
        Col("direction", lambda r: statement(r, alpha), False),
        Col("n", lambda r: f"{num(r.get('n_units'), '{:.0f}')} {r.get('unit') or ''}".strip()),
        Col("sensitivity", text("sensitivity", ""), False),
    ]
    return make_table(
        table_id,
        df.to_dict("records"),
        cols,
        attrs=lambda r: {"family": str(r["family"]), "kind": str(r["kind"])},
    )


def family_lines(out: AnalysisOutputs) -> list[str]:
    """One sentence per model and family: its adjustment, size and rejections."""
    rank = {m: i for i, m in enumerate(out.models)}
    rows = sorted(out.doc.get("families") or [], key=lambda f: rank.get(str(f.get("model")), 0))
    return [
        f"{f.get('model') or 'model'}: {f['family']} family: {f['n_tests']} tests with a "
        f"p-value, {f['adjustment']} at alpha {f['alpha']:g}: {f['n_rejected']} rejected."
        for f in rows
    ]


def kind_lines(out: AnalysisOutputs, kind: str) -> list[str]:
    """One sentence per test of `kind`: estimate, interval, adjusted p, direction."""
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    rows = out.by_model(pd.DataFrame(tests_of(out, kind=kind)), "fraction")
    return [
        f"{t.get('model') or 'model'}: {t['name']} (cache fraction {t['fraction']:g}): "
        f"{t['estimand']} {num(t.get('estimate'), '{:+.3g}')} "
        f"{interval(t.get('ci_lo'), t.get('ci_hi'), '{:+.3g}')} ({ci}), {p_text(t)}: "
        f"{statement(t, alpha)}."
        for t in rows.to_dict("records")
    ]
