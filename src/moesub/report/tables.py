"""The report's tables and headline sentences, formatted from the analysis outputs.

A `Table` is headers plus rows of display strings; the template renders every table the same way
(inside a horizontally scrolling box, so a wide table never widens the page). Headers carry
units; intervals are labelled with the config's `ci_level`; mass is per token-layer throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from moesub.report.load import AnalysisOutputs, ci_label, finite, unique

Row = Mapping[str, Any]


@dataclass
class Table:
    """Headers and display rows; `numeric[i]` right-aligns column i; `attrs` per row."""

    id: str
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool]
    attrs: list[dict[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rows)


@dataclass(frozen=True)
class Col:
    header: str
    cell: Callable[[Row], str]
    numeric: bool = True


def num(v: Any, fmt: str = "{:.3g}") -> str:
    return fmt.format(float(v)) if finite(v) else "—"


def pct(v: Any, digits: int = 1) -> str:
    return f"{100 * float(v):.{digits}f}%" if finite(v) else "—"


def interval(lo: Any, hi: Any, fmt: str = "{:.3g}") -> str:
    if not (finite(lo) and finite(hi)):
        return "—"
    return f"[{fmt.format(float(lo))}, {fmt.format(float(hi))}]"


def first(r: Row, *keys: str) -> Any:
    """The first of `keys` that `r` holds with a value (analysis versions differ in names)."""
    for k in keys:
        v = r.get(k)
        if v is not None and not (isinstance(v, float) and v != v):
            return v
    return None


def make_table(
    table_id: str,
    records: Sequence[Row],
    cols: Sequence[Col],
    attrs: Callable[[Row], dict[str, str]] | None = None,
) -> Table:
    return Table(
        id=table_id,
        headers=[c.header for c in cols],
        rows=[[c.cell(r) for c in cols] for r in records],
        numeric=[c.numeric for c in cols],
        attrs=[attrs(r) for r in records] if attrs else [{} for _ in records],
    )


def text(key: str, empty: str = "—") -> Callable[[Row], str]:
    """The value of `key` as text; `empty` for None and NaN."""
    return lambda r: str(r[key]) if first(r, key) is not None else empty


# ---- policy numbers -----------------------------------------------------------------------------


def policy_numbers(out: AnalysisOutputs) -> dict[str, int]:
    """policy -> its number in the report: the analysis parameters' policies in their order,
    then any other policy of the tables by name; the same number in every model and figure."""
    names = list((out.params.get("policies") or {}).keys())
    for t in ("summary", "speed_quality", "mass_points", "sim_vs_engine"):
        df = out.table(t)
        if "policy" in df.columns:
            names += sorted(df["policy"].astype(str).unique())
    return {n: i + 1 for i, n in enumerate(unique(names))}


# ---- tables -------------------------------------------------------------------------------------


def summary_table(out: AnalysisOutputs, numbers: dict[str, int]) -> Table:
    s = out.table("summary")
    if s.empty:
        return make_table("summary", [], [])
    ci = ci_label(out.ci_level)
    mass = "mass_per_token_layer" if "mass_per_token_layer" in s.columns else "mass_mean"
    # the graded tasks (a free continuation has no accuracy: its section is the degeneration's)
    tasks = sorted(
        c[: -len("_accuracy")] for c in s.columns if c.endswith("_accuracy") and s[c].notna().any()
    )

    def rule(r: Row) -> str:
        out_ = str(first(r, "rule") or "—")
        if r.get("rule") == "threshold" and finite(r.get("tau")):
            out_ += f" τ={float(r['tau']):g}"
        if finite(r.get("beta")) and float(r["beta"]) > 0:
            out_ += f" β={float(r['beta']):g}"
        if isinstance(r.get("eviction"), str):
            out_ += f" {r['eviction']}"
        return out_

    def hit(r: Row) -> str:
        v = first(r, "hit_rate", "sim_hit_rate")
        return pct(v)

    def dppl(r: Row) -> str:
        if not finite(r.get("dppl_pct")):
            return "—"
        return f"{float(r['dppl_pct']):+.2f} {interval(r.get('dppl_ci_lo'), r.get('dppl_ci_hi'))}"

    def task_cell(t: str) -> Callable[[Row], str]:
        def cell(r: Row) -> str:
            acc = r.get(f"{t}_accuracy")
            if not finite(acc):
                return "—"
            lo = first(r, f"{t}_ci_low", f"{t}_acc_ci_lo")
            hi = first(r, f"{t}_ci_high", f"{t}_acc_ci_hi")
            ci_txt = interval(100 * lo, 100 * hi, "{:.0f}") if finite(lo) and finite(hi) else ""
            return f"{100 * float(acc):.1f}% {ci_txt}".strip()

        return cell

    def time_ms(key: str) -> Callable[[Row], str]:
        return lambda r: num(1e3 * float(r[key]) if finite(r.get(key)) else None)

    cols = [
        Col("#", lambda r: str(numbers.get(str(r["policy"]), ""))),
        Col("model", text("model"), False),
        Col("policy", text("policy"), False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("rule", rule, False),
        Col("hit rate", hit),
        Col("substitution rate", lambda r: pct(r.get("sub_rate"), 2)),
        Col("mass / token-layer", lambda r: num(r.get(mass), "{:.4g}")),
        Col(f"Δppl % [{ci}]", dppl),
        *(
            [Col("Δppl bootstrap bias, %", lambda r: num(r.get("dppl_bias"), "{:+.3f}"))]
            if "dppl_bias" in s.columns
            else []
        ),
        *(
            [
                Col(
                    f"Δppl t interval [{ci}] (sensitivity)",
                    lambda r: interval(r.get("dppl_t_ci_lo"), r.get("dppl_t_ci_hi"), "{:+.2f}"),
                )
            ]
            if "dppl_t_ci_lo" in s.columns
            else []
        ),
        *(
            [
                Col(
                    "Δppl MDE, % (normal approximation, sensitivity)",
                    lambda r: num(r.get("dppl_mde_pct"), "{:.3g}"),
                )
            ]
            if "dppl_mde_pct" in s.columns
            else []
        ),
        Col("time / token, ms (engine)", time_ms("time_per_token_s")),
        Col("simulated, ms / token", time_ms("sim_time_per_token_s")),
        Col(
            f"speedup vs {out.baseline}",
            lambda r: num(r.get("speedup_vs_fetch_every_miss"), "{:.2f}×"),
        ),
        *[Col(f"{t} accuracy [{ci}]", task_cell(t)) for t in tasks],
    ]
    s = out.by_model(s.assign(_n=s["policy"].astype(str).map(numbers)), "fraction", "_n")
    return make_table(
        "summary",
        s.to_dict("records"),
        cols,
        attrs=lambda r: {
            "class": "policy-row",
            "policy": str(r["policy"]),
            "model": str(r.get("model", "")),
        },
    )


def mass_table(out: AnalysisOutputs) -> Table:
    """Per model and fraction: the point set of r (and what was left out, why), r with its
    interval, the clusters of mass and the within-cluster r, substitute_all against the line."""
    ci = ci_label(out.ci_level)

    def r_ci(r: Row, key: str = "r") -> str:
        txt = interval(r.get(f"{key}_ci_lo"), r.get(f"{key}_ci_hi"))
        bias = r.get(f"{key}_bias")
        return txt + (f" (bias {float(bias):+.3f})" if finite(bias) else "")

    def left_out(r: Row) -> str:
        return "; ".join(f"{e['policy']}: {e['why']}" for e in r.get("excluded") or []) or "—"

    def span(c: Row) -> str:
        lo, hi = f"{c['mass_lo']:.3g}", f"{c['mass_hi']:.3g}"
        return lo if lo == hi else f"{lo}-{hi}"

    def clusters(r: Row) -> str:
        return "; ".join(f"{c['n']} at {span(c)}" for c in r.get("clusters") or []) or "—"

    def within(r: Row) -> str:
        if r.get("within_r") is None:
            return str(r.get("within_reason") or "—")
        return f"{float(r['within_r']):.3f} {r_ci(r, 'within_r')}"

    def pearson(r: Row) -> str:
        return num(r.get("r"), "{:.3f}") if r.get("r") is not None else str(r.get("reason"))

    def sub_all(r: Row) -> str:
        e = r.get("substitute_all")
        if not e:
            return "did not run"
        out_ = f"mass {e['mass']:.3g}, Δppl {e['dppl_pct']:+.2f}%"
        if e.get("line_dppl_pct") is not None:
            out_ += f"; the line predicts {e['line_dppl_pct']:+.2f}%"
        if e.get("nearest"):
            out_ += (
                f"; {e['nearest']}: mass {e['nearest_mass']:.3g}, "
                f"Δppl {e['nearest_dppl_pct']:+.2f}%"
            )
        return out_

    cols = [
        Col("model", text("model"), False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col(
            "points of r (fetch the first choice)",
            lambda r: ", ".join(r.get("policies") or []),
            False,
        ),
        Col("left out, why", left_out, False),
        Col("n", text("n")),
        Col("Pearson r", pearson, False),
        Col(f"bootstrap {ci} (bias)", r_ci),
        Col(
            f"t interval [{ci}] (sensitivity)",
            lambda r: interval(r.get("r_t_ci_lo"), r.get("r_t_ci_hi")),
        ),
        Col("Spearman ρ", lambda r: num(r.get("rho"), "{:.3f}")),
        Col("clusters of mass (n at range)", clusters, False),
        Col(f"within-cluster r [{ci}]", within),
        Col("substitute_all against the line", sub_all, False),
    ]
    rows = out.by_model(pd.DataFrame(out.doc.get("mass_hypothesis") or []), "fraction")
    return make_table("mass-table", rows.to_dict("records"), cols)


def per_input_table(out: AnalysisOutputs) -> Table:
    """r within each policy across streams and documents, the family-adjusted p beside the raw
    one (the tests `moesub.stats.per_input` names)."""
    df = out.table("per_input")
    ci = ci_label(out.ci_level)
    tests = out.table("tests")

    def key(r: Row) -> tuple:
        name = f"{r['policy']}: r(mass, ΔNLL) across {r['level']}s"
        return str(r.get("model", "")), name, float(r["fraction"])

    adjusted = {}
    if not tests.empty and "p_adjusted" in tests.columns:
        for t in tests[tests["kind"] == "per_input"].to_dict("records"):
            adjusted[(str(t.get("model", "")), t["name"], float(t["fraction"]))] = t["p_adjusted"]
    cols = [
        Col("model", text("model"), False),
        Col("policy", text("policy"), False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("unit", text("level"), False),
        Col("n units", text("n")),
        Col("Pearson r", lambda r: num(r.get("r"), "{:.3f}")),
        Col(f"r {ci}", lambda r: interval(r.get("r_ci_lo"), r.get("r_ci_hi"))),
        Col("interval", text("ci_method", ""), False),
        Col("p (raw)", lambda r: num(r.get("p"), "{:.2g}")),
        Col("p adjusted", lambda r: num(adjusted.get(key(r)), "{:.2g}")),
        Col("Spearman ρ", lambda r: num(r.get("rho"), "{:.3f}")),
        Col("note", text("reason", ""), False),
    ]
    order = out.by_model(df, "policy", "fraction", "level")
    return make_table("per-input-table", order.to_dict("records"), cols)


def generation_table(out: AnalysisOutputs) -> Table:
    """Accuracy per task and policy with its Wilson CI, agreement, mass, and the paired test
    against the baseline (McNemar) with the smallest detectable accuracy drop."""
    df = out.table("generation")
    ci = ci_label(out.ci_level)
    lo, hi = ("ci_low", "ci_high") if "ci_low" in df.columns else ("acc_ci_lo", "acc_ci_hi")
    agree = "agreement" if "agreement" in df.columns else "agree_exact"

    def pct_interval(r: Row, a: str, b: str) -> str:
        if not (finite(r.get(a)) and finite(r.get(b))):
            return "—"
        return interval(100 * float(r[a]), 100 * float(r[b]), "{:.1f}")

    def vs_base(r: Row) -> str:
        if not finite(r.get("accuracy_diff")):
            return "—"
        return f"{100 * float(r['accuracy_diff']):+.1f} pt (McNemar p {num(r.get('mcnemar_p'))})"

    cols = [
        Col("model", text("model"), False),
        Col("task", text("task"), False),
        Col("policy", text("policy"), False),
        Col("n scored", text("n")),
        Col("n missing", lambda r: str(r.get("n_missing") or 0)),
        Col("accuracy", lambda r: pct(r.get("accuracy"))),
        Col(f"accuracy {ci} (Wilson), %", lambda r: pct_interval(r, lo, hi)),
        Col(f"accuracy vs {out.baseline}", vs_base),
        Col("MDE: smallest detectable drop", lambda r: pct(r.get("mdd"))),
        Col(f"agreement with {out.baseline}", lambda r: pct(r.get(agree))),
        Col(
            f"agreement {ci}, %", lambda r: pct_interval(r, "agreement_ci_low", "agreement_ci_high")
        ),
        Col(
            "mass / token-layer",
            lambda r: num(first(r, "mass_per_token_layer", "mass_mean"), "{:.4g}"),
        ),
    ]
    order = out.by_model(df, "task", "policy")
    return make_table("generation-table", order.to_dict("records"), cols)


def generation_missing(out: AnalysisOutputs) -> list[str]:
    """Why problems went unscored, each distinct reason once (per task)."""
    df = out.table("generation")
    if df.empty or "missing_reasons" not in df.columns:
        return []
    reasons = []
    for r in df.to_dict("records"):
        for why in str(r.get("missing_reasons") or "").split("; "):
            if why and f"{r['task']}: {why}" not in reasons:
                reasons.append(f"{r['task']}: {why}")
    return reasons


def frame_table(table_id: str, df: pd.DataFrame) -> Table:
    """Any frame as it is (e.g. the engine benchmark), numbers to 4 significant digits."""
    records = df.to_dict("records")
    cols = [
        Col(str(c), lambda r, c=c: num(r[c], "{:.4g}") if isinstance(r[c], float) else str(r[c]))
        for c in df.columns
    ]
    return make_table(table_id, records, cols)


def models_table(out: AnalysisOutputs) -> Table:
    """One row per model: models.parquet if the analysis wrote it, else each model's provenance."""
    df = out.table("models")
    if df.empty:
        per_model: dict[str, dict[str, Any]] = {m: {"model": m} for m in out.models}
        for p in out.doc.get("provenance") or []:
            m = str(p.get("model", ""))
            if m in per_model:
                meta = p.get("metadata") or {}
                for k in ("num_experts", "top_k", "num_layers"):
                    if k in meta:
                        per_model[m].setdefault(k, meta[k])
        df = pd.DataFrame(list(per_model.values()))
    if "model" in df.columns:
        df = df[["model", *[c for c in df.columns if c != "model"]]]
    return frame_table("model-meta", df)
