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

from moesub.report.load import AnalysisOutputs, ci_label, finite, lacking, regime_wide, unique

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


def power(r: Row) -> str:
    """The design's smallest reachable p and its minimum detectable effect, when recorded."""
    min_p = first(r, "min_p", "min_attainable_p")
    mde = first(r, "mde")
    if min_p is None and mde is None:
        return "—"
    return f"min p {num(min_p)}; MDE {num(mde)}"


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
    """policy -> its number in the report (config order, then any other policy by name)."""
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
    tasks = sorted(c[: -len("_accuracy")] for c in s.columns if c.endswith("_accuracy"))

    def rule(r: Row) -> str:
        out_ = str(r.get("rule") or "—")
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
            [Col("Δppl MDE, %", lambda r: num(r.get("dppl_mde_pct"), "{:.3g}"))]
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
    ci = ci_label(out.ci_level)

    def r_ci(r: Row) -> str:
        txt = interval(first(r, "ci_lo", "r_ci_lo"), first(r, "ci_hi", "r_ci_hi"))
        bias = first(r, "bias", "boot_bias", "r_bias")
        return txt + (f" (bias {float(bias):+.3f})" if finite(bias) else "")

    cols = [
        Col("model", text("model"), False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("group", text("group"), False),
        Col("n policies", text("n")),
        Col(
            "Pearson r",
            lambda r: num(r.get("r"), "{:.3f}") if r.get("r") is not None else str(r.get("reason")),
        ),
        Col(f"bootstrap {ci} (bias-corrected)", r_ci),
        Col("Spearman ρ", lambda r: num(r.get("rho"), "{:.3f}")),
        Col("policies", lambda r: ", ".join(r.get("policies") or []), False),
    ]
    return make_table("mass-table", out.doc.get("mass_hypothesis") or [], cols)


def per_input_table(out: AnalysisOutputs) -> Table:
    df = out.table("per_input")
    ci = ci_label(out.ci_level)
    cols = [
        Col("model", text("model"), False),
        Col("policy", text("policy"), False),
        Col("cache fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("unit", text("level"), False),
        Col("n units", text("n")),
        Col("Pearson r", lambda r: num(r.get("r"), "{:.3f}")),
        Col(f"r {ci}", lambda r: interval(r.get("r_ci_lo"), r.get("r_ci_hi"))),
        Col("Spearman ρ", lambda r: num(r.get("rho"), "{:.3f}")),
        Col("note", text("reason", ""), False),
    ]
    return make_table("per-input-table", df.to_dict("records"), cols)


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
    order = [c for c in ("model", "task", "policy") if c in df.columns]
    return make_table(
        "generation-table", df.sort_values(order).to_dict("records") if order else [], cols
    )


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


def expb_headline(out: AnalysisOutputs) -> list[str]:
    """Experiment B per model and design at the primary m* (analysis.json's decision text for an
    analysis without designs)."""
    side, _ = expb_designs(out)
    if not side:
        return [
            f"{e.get('model') or 'model'}: Experiment B: {e['decision']['outcome_text']}"
            for e in out.doc.get("expb") or []
            if (e.get("decision") or {}).get("outcome_text")
        ]
    df = out.table("expb")
    df = df.assign(model=df["model"] if "model" in df.columns else "")
    if "primary" in df.columns and df["primary"].astype(bool).any():
        df = df[df["primary"].astype(bool)]
    ci = ci_label(out.ci_level)
    lines = []
    for r in df.sort_values(["model", "design"]).to_dict("records"):
        effect = ""
        if finite(r.get("effect")):
            iv = interval(r.get("effect_ci_lo"), r.get("effect_ci_hi"), "{:+.3g}")
            effect = f"effect heavy − light {float(r['effect']):+.3g} {ci} {iv}; "
        lines.append(
            f"{r['model'] or 'model'}: Experiment B, {r['design']} design "
            f"(m* {r['target_mass']:g} per token-layer): {r.get('outcome')}; "
            f"p = {num(r.get('p_value'))} over {r.get('n_streams')} streams ({power(r)}); "
            + effect
            + f"realized heavy {num(r.get('realized_heavy'), '{:.4g}')}, light "
            f"{num(r.get('realized_light'), '{:.4g}')}; support {num(r.get('support'), '{:.3g}')}; "
            f"mean rank substituted heavy {num(r.get('mean_rank_heavy'), '{:.2f}')}"
            f" vs light {num(r.get('mean_rank_light'), '{:.2f}')}."
        )
    return lines


# ---- headline -----------------------------------------------------------------------------------


def headline(out: AnalysisOutputs) -> list[str]:
    """The headline numbers as sentences; every sentence starts with its model's name."""
    ci = ci_label(out.ci_level)

    def who(r: Row) -> str:
        return f"{r.get('model') or 'model'}: "

    lines = []
    for r in out.doc.get("mass_hypothesis") or []:
        what = f"mass hypothesis ({r['group']}, cache fraction {r['fraction']:g})"
        if r.get("r") is not None:
            bias = first(r, "bias", "boot_bias", "r_bias")
            lines.append(
                f"{who(r)}{what}: Pearson r = {r['r']:.3f}, bootstrap {ci} "
                f"{interval(first(r, 'ci_lo', 'r_ci_lo'), first(r, 'ci_hi', 'r_ci_hi'))}"
                + (f", bootstrap bias {float(bias):+.3f}" if finite(bias) else "")
                + f", n = {r['n']} policies."
            )
        else:
            lines.append(f"{who(r)}{what}: {r.get('reason')}; n = {r['n']}.")
    lines += expb_headline(out)
    s = out.table("summary")
    for name in ("quality", "speed", "rule_015", "substitute_all"):
        for r in s[s["policy"] == name].to_dict("records") if "policy" in s else []:
            bits = []
            if finite(r.get("dppl_pct")):
                bits.append(
                    f"Δppl {r['dppl_pct']:+.2f}% {ci} "
                    f"{interval(r.get('dppl_ci_lo'), r.get('dppl_ci_hi'))}"
                )
            if finite(r.get("speedup_vs_fetch_every_miss")):
                bits.append(f"{r['speedup_vs_fetch_every_miss']:.2f}× faster than {out.baseline}")
            if finite(r.get("speedup_vs_host_compute")):
                bits.append(f"{r['speedup_vs_host_compute']:.2f}× vs host_compute")
            if bits:
                lines.append(
                    f"{who(r)}{name} (cache fraction {r['fraction']:g}): " + ", ".join(bits) + "."
                )
    for r in out.doc.get("admission") or []:
        if r.get("segment", "all") != "all":
            continue
        if not finite(r.get("dppl_pct_vs_twin")):
            lines.append(f"{who(r)}admission: {r['policy']}: {r.get('reason') or 'no result'}.")
            continue
        p = first(r, "p_value", "p")
        test = f", one-sided p = {num(p)} ({power({**r, 'mde': r.get('mde_dppl_pct')})})"
        lines.append(
            f"{who(r)}admission: {r['policy']} vs its exact twin {r['twin']}: Δppl "
            f"{r['dppl_pct_vs_twin']:+.2f}% {ci} {interval(r.get('ci_lo'), r.get('ci_hi'))}"
            + (f", bootstrap bias {float(r['bias']):+.3f}" if finite(r.get("bias")) else "")
            + (test if p is not None else "")
            + f", over {r['n_tokens']} tokens."
        )
    return lines


# ---- Experiment B, admission bins, regime ------------------------------------------------------


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


def regime_table(out: AnalysisOutputs) -> Table:
    """Per model and layer ('all': every layer), each figure beside its reference if any."""
    reg = regime_wide(out)
    if reg.empty:
        return make_table("regime-table", [], [])

    def ref(metric: str) -> Col:
        def cell(r: Row) -> str:
            vals = [num(r.get(f"{p}{metric}"), "{:.3f}") for p in ("ref_", "trace_ref_")]
            return " / ".join(v for v in vals if v != "—") or "—"

        return Col("reference (study / trace study)", cell)

    reuse = [c for c in reg.columns if c.startswith("reuse_")]
    cols = [
        Col("model", text("model"), False),
        Col("layer", lambda r: "all" if r.get("layer") == -1 else str(r.get("layer"))),
        Col("hit rate (fetch_every_miss)", lambda r: num(r.get("hit_rate"), "{:.3f}")),
        ref("hit_rate"),
        Col("Belady bound", lambda r: num(r.get("belady_hit_rate"), "{:.3f}")),
        Col("effective experts", lambda r: num(r.get("effective_experts"), "{:.0f}")),
        Col("cache capacity C", lambda r: num(r.get("capacity"), "{:.0f}")),
        Col("routing entropy, nats", lambda r: num(r.get("routing_entropy"), "{:.2f}")),
        Col("ranks 2..k ≥ 0.15", lambda r: pct(r.get("heavy_lower_ranks"))),
        Col("0.15 rule substitution rate", lambda r: pct(r.get("rule015_sub_rate"), 2)),
        ref("rule015_sub_rate"),
        *[
            Col(f"reuse {c.removeprefix('reuse_').replace('_', '-')}", lambda r, c=c: pct(r.get(c)))
            for c in reuse
        ],
    ]
    order = reg.assign(_all=reg["layer"] == -1).sort_values(["model", "_all", "layer"])
    return make_table("regime-table", order.drop(columns="_all").to_dict("records"), cols)


def regime_verdicts(out: AnalysisOutputs) -> list[str]:
    return [
        f"{r.get('model') or 'model'}: {r['verdict']}"
        for r in out.doc.get("regime") or []
        if r.get("verdict")
    ]
