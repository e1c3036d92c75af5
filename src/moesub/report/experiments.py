"""Tables of the findings beside the policy table: Experiment B (both designs side by side) and
the admission effect against exact twins (totals with the test, and by segment and bin); the
regime section's tables are `moesub.report.regime`."""

from __future__ import annotations

from moesub.report.load import AnalysisOutputs, ci_label, finite, lacking
from moesub.report.tables import (
    Col,
    Row,
    Table,
    first,
    interval,
    make_table,
    num,
    power,
    text,
)


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
    "first_document": "each stream's first document (cold cache)",
}


def admission_table(out: AnalysisOutputs) -> Table:
    """Each admission policy vs its exact twin: all tokens (with the test) and per segment."""
    ci = ci_label(out.ci_level)

    def dppl(r: Row) -> str:
        if not finite(r.get("dppl_pct_vs_twin")):
            return str(r.get("reason") or "—")
        bias = f" (bias {float(r['bias']):+.3f})" if finite(r.get("bias")) else ""
        iv = interval(r.get("ci_lo"), r.get("ci_hi"), "{:+.3f}")
        return f"{float(r['dppl_pct_vs_twin']):+.3f} {iv}{bias}"

    def admission_power(r: Row) -> str:
        return power({**r, "mde": first(r, "mde_dppl_pct", "mde")})

    cols = [
        Col("model", text("model"), False),
        Col("policy", text("policy"), False),
        Col("exact twin (β = 0)", lambda r: str(r.get("twin") or "none"), False),
        Col(
            "tokens",
            lambda r: SEGMENT_LABELS.get(str(r.get("segment")), str(r.get("segment"))),
            False,
        ),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("n tokens", lambda r: str(r.get("n_tokens") if r.get("n_tokens") is not None else "—")),
        Col(f"Δppl % vs twin [{ci}] (bootstrap bias)", dppl),
        Col("p (one-sided Wilcoxon)", lambda r: num(first(r, "p_value", "p"))),
        Col("power: smallest p; MDE Δppl %", admission_power, False),
    ]
    return make_table("admission-table", out.doc.get("admission") or [], cols)


def expb_designs(out: AnalysisOutputs) -> tuple[Table, Table]:
    """Both designs side by side at the primary m* (metric rows, one column per model and
    design), and every (model, design, target) row."""
    df = out.table("expb")
    ci = ci_label(out.ci_level)
    if df.empty or lacking(df, "expb"):  # the figure says which columns are missing
        return make_table("expb-designs", [], []), make_table("expb-all", [], [])
    lo = "effect_ci_lo" if "effect_ci_lo" in df.columns else "ci_lo"
    hi = "effect_ci_hi" if "effect_ci_hi" in df.columns else "ci_hi"

    def effect(r: Row) -> str:
        return f"{num(r.get('effect'), '{:+.4g}')} {interval(r.get(lo), r.get(hi), '{:+.3g}')}"

    def ranks(r: Row) -> str:
        h, light = r.get("mean_rank_heavy"), r.get("mean_rank_light")
        return f"heavy {num(h, '{:.2f}')} vs light {num(light, '{:.2f}')}"

    def outcome(r: Row) -> str:
        """The short outcome; an invalid design also says why (the analysis's full text)."""
        short = str(r.get("outcome") or "—")
        return str(r.get("outcome_text") or short) if short.startswith("invalid") else short

    def valid(r: Row) -> str:
        return "—" if r.get("valid") is None else ("yes" if r["valid"] else "no")

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
        ("outcome", outcome),
        ("p (one-sided Wilcoxon)", lambda r: num(first(r, "p_value", "p"))),
        ("n streams", lambda r: str(r.get("n_streams") if r.get("n_streams") is not None else "—")),
        (f"effect heavy − light [{ci}]", effect),
        ("rank confound (mean rank substituted)", ranks),
        ("power: smallest p; MDE", power),
    ]
    if "model" not in df.columns:
        df = df.assign(model="")
    if "primary" in df.columns and df["primary"].astype(bool).any():
        at = df[df["primary"].astype(bool)]
    else:  # no primary target ran: the smallest per model and design
        at = df.sort_values("target_mass").drop_duplicates(["model", "design"])
    at = at.sort_values(["model", "design"]).to_dict("records")
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
        *[Col(label, cell, label in ("valid", "outcome")) for label, cell in metrics],
    ]
    return side, make_table(
        "expb-all", df.sort_values(["model", "design", "target_mass"]).to_dict("records"), cols
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
        Col(
            "segment",
            lambda r: SEGMENT_LABELS.get(str(r.get("segment")), str(r.get("segment", "—"))),
            False,
        ),
        Col("tokens since the document's first token", text("bin_label"), False),
        Col("n tokens", text("n_tokens")),
        Col("streams", text("n_streams")),
        Col("ΔNLL / token", lambda r: num(r.get("dnll_mean"), "{:+.4f}")),
        Col(ci, lambda r: interval(r.get("ci_lo"), r.get("ci_hi"), "{:+.4f}")),
        Col("bootstrap bias", lambda r: num(r.get("bias"), "{:+.2g}")),
    ]
    order = [c for c in ("model", "policy", "fraction", "segment", "bin") if c in adm.columns]
    return make_table("admission-bins", adm.sort_values(order).to_dict("records"), cols)
