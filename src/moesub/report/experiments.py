"""Tables of the three findings beside the policy table: Experiment B (both designs side by
side, the two-sided statement first, the pre-registered one-sided rule beside it), the admission
effect against exact twins (the primary estimand with its adjusted p, by segment and profile,
and by bin); the regime section's tables are `moesub.report.regime`."""

from __future__ import annotations

import pandas as pd

from moesub.report.claims import p_text, statement, test_of, test_words
from moesub.report.load import AnalysisOutputs, ci_label, finite, lacking
from moesub.report.tables import Col, Row, Table, interval, make_table, num, text


def expb_rules(out: AnalysisOutputs) -> list[str]:
    """Each design's pre-registered validity condition, from the analysis parameters."""
    designs = (out.params.get("expb") or {}).get("designs") or {}
    lines = []
    for name, d in designs.items():
        cond = [f"primary m* = {d.get('primary')} per token-layer"]
        if finite(d.get("heavy_mass")):
            cond.append(f"heavy expert weight {d['heavy_mass']:g} ± 10%")
        if finite(d.get("max_gap")):
            cond.append(f"realized masses within {100 * d['max_gap']:g}% of each other")
        if finite(d.get("min_heavy_fraction")):
            cond.append(f"heavy realizes ≥ {100 * d['min_heavy_fraction']:g}% of m*")
        if finite(d.get("min_realized_fraction")):
            cond.append(f"both realize ≥ {100 * d['min_realized_fraction']:g}% of m*")
        lines.append(f"{name}: " + "; ".join(cond))
    return lines


SEGMENT_LABELS = {
    "all": "all tokens",
    "after_change": "after a topic change",
    "first_document": "each stream's first document (cache warm from the initial set)",
    "after_change_early": "after a topic change, the first tokens",
    "after_change_late": "after a topic change, later tokens",
}


def segment_label(r: Row) -> str:
    label = SEGMENT_LABELS.get(str(r.get("segment")), str(r.get("segment", "—")))
    n = r.get("early_tokens")
    if r.get("segment") == "after_change_early" and n:
        label = f"after a topic change, the first {n} tokens"
    elif r.get("segment") == "after_change_late" and n:
        label = f"after a topic change, after the first {n} tokens"
    return label


def admission_table(out: AnalysisOutputs) -> Table:
    """Each admission policy vs its exact twin: the primary estimand (mean ΔNLL, two-sided)
    over all tokens with its adjusted p, per segment, and the profile after a topic change."""
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    rows = [r for r in out.doc.get("admission") or [] if finite(r.get("dppl_pct_vs_twin"))]
    early = {
        (r.get("model"), r["policy"], r["fraction"]): r.get("early_tokens")
        for r in rows
        if r.get("segment") == "all"
    }
    rows = [
        {**r, "early_tokens": early.get((r.get("model"), r["policy"], r["fraction"]))} for r in rows
    ]

    def dnll(r: Row) -> str:
        iv = interval(r.get("dnll_ci_lo"), r.get("dnll_ci_hi"), "{:+.4f}")
        return f"{num(r.get('dnll_mean'), '{:+.4f}')} {iv}"

    def dppl(r: Row) -> str:
        iv = interval(r.get("ci_lo"), r.get("ci_hi"), "{:+.3f}")
        return f"{num(r.get('dppl_pct_vs_twin'), '{:+.3f}')} {iv}"

    def test(r: Row) -> Row:
        name = f"{r['policy']} vs {r['twin']}"
        if r.get("segment") in ("after_change_early", "after_change_late"):
            n = r.get("early_tokens")
            name += (
                f", first {n} tokens after a change"
                if r["segment"] == "after_change_early"
                else f", after the first {n} tokens"
            )
        elif r.get("segment") != "all":
            return {}
        return test_of(out, r.get("model"), name=name, fraction=r["fraction"])

    def adjusted(r: Row) -> str:
        return test_words(test(r), alpha, "{:.2g}") or "—"

    def sensitivity(r: Row) -> str:
        if r.get("segment") != "all" or not finite(r.get("wilcoxon_p")):
            return ""
        return (
            f"Wilcoxon signed-rank, two-sided, per-stream means (a pseudo-median): "
            f"p = {float(r['wilcoxon_p']):.2g}"
        )

    cols = [
        Col("model", text("model"), False),
        Col("policy vs exact twin (β = 0)", lambda r: f"{r['policy']} vs {r['twin']}", False),
        Col("tokens", segment_label, False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("n tokens", text("n_tokens")),
        Col(f"mean ΔNLL / token [{ci}] (primary)", dnll),
        Col(f"= Δppl % vs twin [{ci}]", dppl),
        Col("p (two-sided, raw)", lambda r: num(test(r).get("p_value"), "{:.2g}")),
        Col("adjusted p: direction", adjusted, False),
        Col("profile after a change", text("profile", ""), False),
        Col("sensitivity", sensitivity, False),
    ]
    return make_table("admission-table", out.by_model(pd.DataFrame(rows)).to_dict("records"), cols)


def expb_designs(out: AnalysisOutputs) -> tuple[Table, Table]:
    """Both designs side by side at the primary m* (metric rows, one column per model and
    design), and every (model, design, target) row."""
    df = out.table("expb")
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    if df.empty or lacking(df, "expb"):  # the figure says which columns are missing
        return make_table("expb-designs", [], []), make_table("expb-all", [], [])
    lo = "effect_ci_lo" if "effect_ci_lo" in df.columns else "ci_lo"
    hi = "effect_ci_hi" if "effect_ci_hi" in df.columns else "ci_hi"

    def test(r: Row) -> Row:
        name = f"{r['design']} design, m* {r['target_mass']:g}"
        return test_of(out, r.get("model") or None, name=name)

    def effect(r: Row) -> str:
        return f"{num(r.get('effect'), '{:+.4g}')} {interval(r.get(lo), r.get(hi), '{:+.3g}')}"

    def mean_t(r: Row) -> str:
        iv = interval(r.get("mean_t_ci_lo"), r.get("mean_t_ci_hi"), "{:+.3g}")
        return f"{num(r.get('mean_d'), '{:+.4g}')} {iv}"

    def ranks(r: Row) -> str:
        h, light = r.get("mean_rank_heavy"), r.get("mean_rank_light")
        return f"heavy {num(h, '{:.2f}')} vs light {num(light, '{:.2f}')}"

    def outcome(r: Row) -> str:
        """The one-sided rule's outcome; an invalid design also says why."""
        short = str(r.get("outcome") or "—")
        return str(r.get("outcome_text") or short) if short.startswith("invalid") else short

    def valid(r: Row) -> str:
        return "—" if r.get("valid") is None else ("yes" if r["valid"] else "no")

    def mde(r: Row) -> str:
        return (
            f"{num(r.get('mde'), '{:.2g}')} (normal approximation)" if finite(r.get("mde")) else "—"
        )

    metrics = [
        ("support (eligible token-layers)", lambda r: num(r.get("support"), "{:.4g}")),
        (
            "calibration: support; reachable m* up to",
            lambda r: (
                f"{num(r.get('calib_support'), '{:.4g}')}; {num(r.get('max_target'), '{:.4g}')}"
            ),
        ),
        ("realized heavy / token-layer", lambda r: num(r.get("realized_heavy"), "{:.4g}")),
        ("realized light / token-layer", lambda r: num(r.get("realized_light"), "{:.4g}")),
        ("valid", valid),
        (
            "direction (two-sided, adjusted p)",
            lambda r: statement(test(r), alpha, "{:.2g}") if test(r) else "—",
        ),
        (f"effect heavy − light, Hodges-Lehmann [{ci}]", effect),
        (
            "p (two-sided Wilcoxon, raw; adjusted)",
            lambda r: p_text(test(r)) if test(r) else "—",
        ),
        (f"mean heavy − light [t {ci}] (sensitivity)", mean_t),
        ("MDE of the mean (sensitivity)", mde),
        ("pre-registered one-sided rule", outcome),
        ("n streams", lambda r: str(r.get("n_streams") if r.get("n_streams") is not None else "—")),
        ("rank confound (mean rank substituted)", ranks),
    ]
    if "model" not in df.columns:
        df = df.assign(model="")
    if "primary" in df.columns and df["primary"].astype(bool).any():
        at = df[df["primary"].astype(bool)]
    else:  # no primary target ran: the smallest per model and design
        at = df.sort_values("target_mass").drop_duplicates(["model", "design"])
    at = out.by_model(at, "design").to_dict("records")
    side = Table(
        id="expb-designs",
        headers=[
            "at the primary m*",
            *[f"{r.get('model', '')} · {r['design']} (m* {r['target_mass']:g})" for r in at],
        ],
        rows=[[label, *[cell(r) for r in at]] for label, cell in metrics],
        numeric=[False, *[True for _ in at]],
        attrs=[{} for _ in metrics],
    )
    cols = [
        Col("model", text("model"), False),
        Col("design", text("design"), False),
        Col("target m* / token-layer", lambda r: num(r.get("target_mass"), "{:g}")),
        *[Col(label, cell, label not in WORDS) for label, cell in metrics],
    ]
    return side, make_table(
        "expb-all", out.by_model(df, "design", "target_mass").to_dict("records"), cols
    )


# the Experiment B rows that are words, not numbers (left-aligned)
WORDS = (
    "valid",
    "direction (two-sided, adjusted p)",
    "p (two-sided Wilcoxon, raw; adjusted)",
    "pre-registered one-sided rule",
    "rank confound (mean rank substituted)",
)


def admission_bins_table(out: AnalysisOutputs) -> Table:
    """ΔNLL by bin of tokens since the document's first token, per segment: the boundary token
    (the document's first) and each stream's first document are rows of their own."""
    adm = out.table("admission")
    if adm.empty or lacking(adm, "admission"):
        return make_table("admission-bins", [], [])
    ci = ci_label(out.ci_level)
    cols = [
        Col("model", text("model"), False),
        Col("policy vs exact twin", lambda r: f"{r['policy']} vs {r['twin']}", False),
        Col("segment", segment_label, False),
        Col("tokens since the document's first token", text("bin_label"), False),
        Col("n tokens", text("n_tokens")),
        Col("streams", text("n_streams")),
        Col("ΔNLL / token", lambda r: num(r.get("dnll_mean"), "{:+.4f}")),
        Col(ci, lambda r: interval(r.get("ci_lo"), r.get("ci_hi"), "{:+.4f}")),
        Col("bootstrap bias", lambda r: num(r.get("bias"), "{:+.2g}")),
    ]
    order = out.by_model(adm, "policy", "fraction", "segment", "bin")
    return make_table("admission-bins", order.to_dict("records"), cols)
