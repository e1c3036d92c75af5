"""The report's regime section: each model's cache regime beside the reference figures, its
static skew beside the real reference model's, and every pinning or allocation design beside its
counterpart on the evaluation trace and on the skew-matched trace (the same streams with the
real model's pooled expert popularity, `moesub.skewmatch`)."""

from __future__ import annotations

from typing import Any

from moesub.report.load import AnalysisOutputs, ci_label, finite, regime_wide
from moesub.report.tables import Col, Row, Table, interval, make_table, num, pct, text


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
        Col("layer", _layer),
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
    return make_table("regime-table", _layer_order(out, reg), cols)


def regime_verdicts(out: AnalysisOutputs) -> list[str]:
    """Per model the regime verdict, then the static-skew line when the analysis has one."""
    lines = []
    for r in out.doc.get("regime") or []:
        model = r.get("model") or "model"
        lines += [f"{model}: {r['verdict']}"] if r.get("verdict") else []
        skew = r.get("skew") or {}
        lines += [f"{model}: {skew['verdict']}"] if skew.get("verdict") else []
    return lines


def skew_table(out: AnalysisOutputs) -> Table:
    """Per model and layer: effective experts and top-C coverage (the study's C and every
    configured size), the calibration set's coverage and the fetch_every_miss hit rate, each on
    the model's evaluation trace beside the real model and the skew-matched trace."""
    reg = regime_wide(out)
    if reg.empty or "top_coverage" not in reg.columns:
        return make_table("skew-table", [], [])
    study = {str(r.get("model", "")): (r.get("skew") or {}) for r in out.doc.get("regime") or []}

    def trio(metric: str, fmt: str, real: bool = True, matched: bool = True) -> Col:
        keys = [metric, *(["real_" + metric] * real), *(["matched_" + metric] * matched)]
        names = ["model", *(["real"] * real), *(["skew-matched"] * matched)]
        label = {"effective_experts": "effective experts"}.get(metric, metric)
        return Col(
            f"{label} ({' / '.join(names)})",
            lambda r: " / ".join(num(r.get(k), fmt) for k in keys),
        )

    def coverage(r: Row) -> str:
        return " / ".join(num(r.get(k), "{:.3f}") for k in _prefixed("top_coverage"))

    def hits(r: Row) -> str:
        cells = [num(r.get("hit_rate"), "{:.3f}"), num(r.get("matched_hit_rate"), "{:.3f}")]
        real = (study.get(str(r.get("model", ""))) or {}).get("real_lru_hit_rates") or []
        if r.get("layer") == -1 and real:
            cells.append(f"{min(real):.2f}–{max(real):.2f}")
        return " / ".join(cells)

    c = {m: s.get("study_capacity") for m, s in study.items()}
    cap = next((v for v in c.values() if v), "C")
    sizes = sorted(
        col.removeprefix("top_coverage_")
        for col in reg.columns
        if col.startswith("top_coverage_") and f"real_{col}" in reg.columns
    )
    cols = [
        Col("model", text("model"), False),
        Col("layer", _layer),
        trio("effective_experts", "{:.0f}"),
        Col(f"top-{cap} coverage (model / real / skew-matched)", coverage),
        *[
            Col(
                f"top-C coverage at {s} (model / real)",
                lambda r, s=s: " / ".join(
                    num(r.get(k), "{:.3f}") for k in (f"top_coverage_{s}", f"real_top_coverage_{s}")
                ),
            )
            for s in sizes
        ],
        Col(
            "calibration's first C cover (model / skew-matched)",
            lambda r: " / ".join(
                num(r.get(k), "{:.3f}") for k in ("initial_coverage", "matched_initial_coverage")
            ),
        ),
        Col("fetch_every_miss hit rate (model / skew-matched / real replays)", hits),
    ]
    return make_table("skew-table", _layer_order(out, reg), cols)


def designs_table(out: AnalysisOutputs) -> Table:
    """Per model, design and size: hit rate and misses per token of the design and its
    counterpart on each trace, the design's gain on each, and the change in the gain."""
    des = out.table("regime_designs")
    if des.empty or "gain_change" not in des.columns:
        return make_table("regime-designs", [], [])

    def pair(measure: str, world: str, fmt: str, delta: str) -> Col:
        name = {"hit_rate": "hit rate", "misses_per_token": "misses per token"}[measure]
        trace = {"evaluation": "evaluation trace", "skew_matched": "skew-matched"}[world]

        def cell(r: Row) -> str:
            a, b = r.get(f"{measure}_{world}"), r.get(f"counterpart_{measure}_{world}")
            d = r.get(f"{delta}_{world}")
            return f"{num(a, fmt)} / {num(b, fmt)} ({num(d, '{:+' + fmt[2:])})"

        return Col(f"{name}, {trace}: design / counterpart (Δ)", cell)

    cols = [
        Col("model", text("model"), False),
        Col("design", text("design"), False),
        Col("adds", text("change"), False),
        Col("counterpart", text("counterpart"), False),
        Col("size", text("size"), False),
        Col(
            "slots per layer (evaluation / skew-matched)",
            lambda r: _slots(r.get("capacities_evaluation"), r.get("capacities_skew_matched")),
            False,
        ),
        pair("hit_rate", "evaluation", "{:.3f}", "gain"),
        pair("hit_rate", "skew_matched", "{:.3f}", "gain"),
        pair("misses_per_token", "evaluation", "{:.2f}", "miss_change"),
        pair("misses_per_token", "skew_matched", "{:.2f}", "miss_change"),
        Col("gain change under the real skew", lambda r: num(r.get("gain_change"), "{:+.3f}")),
    ]
    records = out.by_model(des, "design", "capacity").to_dict("records")
    return make_table("regime-designs", records, cols)


SIDES = ("planned", "uniform")


def allocation_table(out: AnalysisOutputs) -> Table:
    """Per model, planned policy and fraction (moesub.stats.allocation): slots, emulated hit
    rates and Δppl of planned and uniform, the paired Δppl difference with its CI and p, and the
    simulated time ratio planned / uniform on the study's profile and over the priced ones."""
    alloc = out.table("allocation")
    if alloc.empty or "diff_dppl_pct" not in alloc.columns:
        return make_table("allocation-table", [], [])

    def both(col: str, label: str, fmt: str) -> Col:
        return Col(
            f"{label} (planned / uniform)",
            lambda r: " / ".join(num(r.get(f"{side}_{col}"), fmt) for side in SIDES),
            False,
        )

    def ratios(r: Row) -> str:
        lo, hi = r.get("time_ratio_min"), r.get("time_ratio_max")
        study = num(r.get("time_ratio_study"), "{:.3f}")
        return f"{study} ({num(lo, '{:.3f}')}–{num(hi, '{:.3f}')} over {r.get('n_profiles')})"

    cols = [
        Col("model", text("model"), False),
        Col("planned", text("planned"), False),
        Col("uniform", text("uniform"), False),
        Col("fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col(
            "slots per layer (planned / uniform)",
            lambda r: f"{r.get('planned_slots') or '—'} / {r.get('uniform_slots') or '—'}",
            False,
        ),
        both("hit_rate", "hit rate", "{:.3f}"),
        both("dppl_pct", "Δppl %", "{:+.2f}"),
        Col(
            f"Δppl planned − uniform, pts [{ci_label(out.ci_level)}]",
            lambda r: (
                f"{num(r.get('diff_dppl_pct'), '{:+.2f}')} "
                + interval(r.get("diff_ci_lo"), r.get("diff_ci_hi"), "{:+.2f}")
            ),
        ),
        Col("p (two-sided)", lambda r: num(r.get("diff_p"), "{:.3g}")),
        Col("MDE, pts", lambda r: num(r.get("diff_mde"), "{:.2f}")),
        Col("simulated time planned / uniform: study profile (range)", ratios),
    ]
    records = out.by_model(alloc, "planned", "fraction").to_dict("records")
    return make_table("allocation-table", records, cols)


def regime_design_lines(out: AnalysisOutputs) -> list[str]:
    """One sentence per design and size: its gain over its counterpart on the evaluation trace
    and under the real model's skew."""
    des = out.table("regime_designs")
    if des.empty or "gain_change" not in des.columns:
        return []
    lines = []
    for r in out.by_model(des, "design", "capacity").to_dict("records"):
        if not (finite(r.get("gain_evaluation")) and finite(r.get("gain_skew_matched"))):
            continue
        change = float(r["gain_change"])
        how = "shrinks" if change < 0 else "grows"
        lines.append(
            f"{r.get('model') or 'model'}: {r['design']} at {r['size']} ({r['change']} over "
            f"{r['counterpart']}): {_gain(r, 'evaluation')} on the evaluation trace, "
            f"{_gain(r, 'skew_matched')} under the real model's skew: the gain {how} by "
            f"{abs(change):.3f}"
        )
    return lines


def _gain(r: dict[str, Any], world: str) -> str:
    return (
        f"{float(r[f'gain_{world}']):+.3f} hit rate "
        f"({float(r[f'miss_change_{world}']):+.2f} misses per token)"
    )


def _slots(evaluation: Any, matched: Any) -> str:
    return str(evaluation) if evaluation == matched else f"{evaluation} / {matched}"


def _prefixed(metric: str) -> tuple[str, str, str]:
    return metric, f"real_{metric}", f"matched_{metric}"


def _layer(r: Row) -> str:
    return "all" if r.get("layer") == -1 else str(r.get("layer"))


def _layer_order(out: AnalysisOutputs, reg: Any) -> list[dict[str, Any]]:
    """Rows per model (the analysis' order), layers ascending, the all-layers row last."""
    order = out.by_model(reg.assign(_all=reg["layer"] == -1), "_all", "layer")
    return order.drop(columns="_all").to_dict("records")
