"""The report's opening: the recommendation per model, hardware and cache size (one row per
ranking, `moesub.recommend`), then what the table rests on, in sentences: the split the
choice was screened and reported on, the timing uncertainty of each source, the ties the
simpler policy won and the sizes without a choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moesub.report.load import finite, load_plans, unique
from moesub.report.tables import Col, Row, Table, interval, make_table, num, pct

Doc = dict[str, Any]


def rows_of(docs: list[Doc], models: list[str] | None = None) -> list[Row]:
    """One row per ranking of every document (models in `models`' order, then hardware, size
    and source as the documents list them), each with its document's keys under `doc`."""
    rank = {m: i for i, m in enumerate(models or [])}
    ordered = sorted(docs, key=lambda d: rank.get(str(d.get("model")), len(rank)))
    return [{**r, "doc": d} for d in ordered for r in d.get("rankings") or []]


def source_of(r: Row) -> str:
    if r["time_source"] != "engine":
        return "simulator"
    return "engine" + (f" ({r['device']})" if r.get("device") else "")


def per_layer(counts: list[int] | None) -> str:
    """Per-layer counts in a few characters: "128 × 4 layers", or "96-160 (mean 128)"."""
    if not counts:
        return "—"
    if len(set(counts)) == 1:
        return f"{counts[0]} × {len(counts)} layers"
    return f"{min(counts)}-{max(counts)} (mean {sum(counts) / len(counts):.4g})"


def layout(c: Row) -> str:
    """Slots per layer, and the pinned ones if any: "128 × 4 layers / none pinned"."""
    pins = c.get("pins_per_layer") or []
    pinned = per_layer(pins) if any(pins) else "none"
    return f"{per_layer(c.get('slots_per_layer'))} / {pinned} pinned"


def both_speedups(c: Row) -> str:
    """The two speedups of a choice, points only: "1.00× / 1.50×"."""
    x = [c.get(k) for k in ("speedup_vs_fetch_every_miss", "speedup_vs_host_compute")]
    return " / ".join(f"{float(v):.2f}×" if finite(v) else "—" for v in x)


def with_interval(x: Any, lo: Any, hi: Any, fmt: str) -> str:
    """`x` and, unless it is the point itself at this precision, its interval."""
    if not finite(x):
        return "—"
    shown = fmt.format(float(x))
    if finite(lo) and finite(hi) and fmt.format(float(lo)) != fmt.format(float(hi)):
        shown += f" {interval(lo, hi, fmt)}"
    return shown


def of_choice(kind: str, cell: Callable[[Row], str]) -> Callable[[Row], str]:
    """A cell of the ranking's `kind` choice; "—" where there is none."""
    return lambda r: cell(r[kind]) if r.get(kind) is not None else "—"


def speedup(column: str) -> Callable[[Row], str]:
    """A speedup with its interval; "(slower)" after one below 1 (never "0.96× faster")."""

    def cell(c: Row) -> str:
        x = c.get(column)
        shown = with_interval(x, c.get(f"{column}_lo"), c.get(f"{column}_hi"), "{:.2f}×")
        return shown + (" (slower)" if finite(x) and round(float(x), 2) < 1 else "")

    return cell


def tokens_per_s(c: Row) -> str:
    """Tokens per second with its interval (from the time's: 1 / hi, 1 / lo)."""
    t, lo, hi = (c.get(k) for k in ("time_per_token_s", "time_lo_s", "time_hi_s"))
    if not finite(t):
        return "—"
    inv = [1 / float(v) if finite(v) and float(v) > 0 else None for v in (t, hi, lo)]
    return with_interval(*inv, "{:.3g}")


def dppl(prefix: str) -> Callable[[Row], str]:
    return lambda c: (
        f"{num(c.get(f'{prefix}dppl_pct'), '{:+.2f}')} "
        f"{interval(c.get(f'{prefix}dppl_ci_lo'), c.get(f'{prefix}dppl_ci_hi'), '{:+.2f}')}"
    )


def recommendation_table(docs: list[Doc], ci: str, models: list[str] | None = None) -> Table:
    """The report's first table: one row per (model, hardware, cache size, time source)."""
    base = "fetch_every_miss"
    host = "host_compute"
    if docs:
        base, host = docs[0].get("baseline", base), docs[0].get("host_baseline", host)
    w, ll = "within_budget", "lossless"
    rows = rows_of(docs, models)
    several = len({str(r["doc"]["model"]) for r in rows}) > 1
    cols = [
        *([Col("model", lambda r: str(r["doc"]["model"]), numeric=False)] if several else []),
        Col("hardware", lambda r: str(r["hardware"]), numeric=False),
        Col("cache size", lambda r: f"{r['size']} (C = {r['capacity']})", numeric=False),
        Col("time from", source_of, numeric=False),
        Col("within the Δppl budget", lambda r: _policy(r, w), numeric=False),
        Col("slots / pinned per layer", of_choice(w, layout)),
        Col("tokens/s", of_choice(w, tokens_per_s)),
        Col(f"× vs {base}", of_choice(w, speedup("speedup_vs_fetch_every_miss"))),
        Col(f"× vs {host}", of_choice(w, speedup("speedup_vs_host_compute"))),
        Col("hit rate", of_choice(w, lambda c: pct(c.get("hit_rate")))),
        Col(f"Δppl % on the report half ({ci})", of_choice(w, dppl("report_"))),
        Col(f"Δppl % on all streams ({ci})", of_choice(w, dppl(""))),
        Col("lossless", lambda r: _policy(r, ll), numeric=False),
        Col("lossless tokens/s", of_choice(ll, tokens_per_s)),
        Col(f"lossless × vs {base} / {host}", of_choice(ll, both_speedups)),
    ]
    return make_table("recommendation-table", rows, cols)


def recommendation_lines(docs: list[Doc], ci: str, models: list[str] | None = None) -> list[str]:
    """What the table rests on, per model: the split, the budget, each source's timing
    uncertainty, the ties the simpler policy won and every ranking without a choice."""
    rank = {m: i for i, m in enumerate(models or [])}
    lines = []
    for d in sorted(docs, key=lambda d: rank.get(str(d.get("model")), len(rank))):
        m = d["model"]
        s = d.get("selection")
        budget = f"{d['dppl_budget_pct']:g}%"
        if s:
            lines.append(
                f"{m}: candidates screened on {len(s['screen_streams'])} of the "
                f"{s.get('n_streams', '?')} evaluation streams (ids {_ids(s['screen_streams'])}): "
                f"a policy qualifies when its Δppl upper {ci} bound there is <= {budget}; the "
                f"chosen policy's Δppl is reported on the other {len(s['report_streams'])} "
                f"(ids {_ids(s['report_streams'])}), which it was not chosen on; split seeded "
                f"by analysis.seed = {s['seed']}."
            )
        else:
            lines.append(f"{m}: no split of the streams; nothing could be screened.")
        for text in unique(r["timing"]["text"] for r in d.get("rankings") or []):
            lines.append(f"{m}: {text}.")
        for r in d.get("rankings") or []:
            where = f"{m}, {r['hardware']}, {r['size']}, {source_of(r)}"
            if r.get("quality_proxy") is not None:
                lines.append(trace_line(f"{m} (router trace, simulated only), {r['hardware']}, "
                                        f"{r['size']}", r))  # fmt: skip
            for kind, label in (("within_budget", "within budget"), ("lossless", "lossless")):
                c = r.get(kind)
                if c is None:
                    lines.append(f"{where}: no {label} choice: {r.get(f'{kind}_reason')}.")
                elif c.get("fastest") and c["fastest"] != c["policy"]:
                    others = [t for t in c.get("tied") or [] if t != c["fastest"]]
                    verb = "is" if len(others) == 1 else "are"
                    fields = ", ".join(c.get("non_default_fields") or []) or "none"
                    lines.append(
                        f"{where}: {label}: {c['fastest']} is the fastest; {', '.join(others)} "
                        f"{verb} within its timing noise, and {c['policy']} has the fewest "
                        f"non-default fields ({fields}): chosen."
                    )
    return lines


def trace_line(where: str, r: Row) -> str:
    """A trace model's ranking (`moesub.recommend.trace`): the fastest policy with its hit rate
    and substituted mass, the quality proxy, with the mass hypothesis' r where Δppl was
    measured on another model."""
    proxy = r["quality_proxy"]
    how = (
        f"r = {float(proxy['r']):.2f} with Δppl % on {proxy.get('from_model')}"
        if finite(proxy.get("r"))
        else f"no r: {proxy.get('reason')}"
    )
    c = r.get("fastest")
    if c is None:
        return f"{where}: no fastest policy: {r.get('fastest_reason')}."
    x = speedup("speedup_vs_fetch_every_miss")(c)
    return (
        f"{where}: fastest: {c['policy']} ({x} vs fetch_every_miss), hit rate "
        f"{pct(c.get('hit_rate'))}, substituted mass {num(c.get('substituted_mass'), '{:.3g}')} "
        f"per token-layer ({proxy['label']}; {how})."
    )


def _policy(r: Row, kind: str) -> str:
    c = r.get(kind)
    return str(c["policy"]) if c is not None else "none (see below)"


def _ids(ids: list[int]) -> str:
    return ", ".join(str(i) for i in ids)


def against_study(c: dict[str, Any]) -> str:
    """Where a predicted speedup's interval lies against the study's range, said as such."""
    lo, hi = (c[k] if finite(c.get(k)) else c["speedup"] for k in ("speedup_lo", "speedup_hi"))
    if hi < c["study_low"]:
        return "the interval lies below the study's range, against it"
    if lo > c["study_high"]:
        return "the interval lies above the study's range, against it"
    return "the interval reaches the study's range, consistent with it"


def study_lines(docs: list[Doc], models: list[str] | None = None) -> list[str]:
    """Against the study's table (`moesub.recommend.study`), per model: the predicted speedups
    beside the study's, then why they differ, from the run's rates and the profile's seconds."""
    rank = {m: i for i, m in enumerate(models or [])}
    lines = []
    for d in sorted(docs, key=lambda d: rank.get(str(d.get("model")), len(rank))):
        s, m = d.get("study"), d["model"]
        if not s:
            continue
        at = f"{s['hardware']} at {100 * s['fraction']:g}% resident"
        if not s["priced"]:
            lines.append(f"{m}: {at}: no prediction: {s['reason']}.")
        for c in s["comparisons"] if s["priced"] else []:
            study = f"the study measured {c['study_low']:g}-{c['study_high']:g}×"
            if finite(c.get("speedup")):
                x, study = speedup("speedup")(c), f"{study}: {against_study(c)}"
            else:
                x = "not predicted"
            lines.append(
                f"{m}: {c['policy']} vs {c['reference']} on {at}: {x} (simulator); {study}."
            )
        rates = []
        if finite(s.get("miss_rate")):
            rates.append(
                f"fetch_every_miss misses {pct(s['miss_rate'])} of expert calls (the study's "
                f"cache: {pct(s['study_miss_rate'])})"
            )
        if finite(s.get("sub_rate")):
            rates.append(
                f"rule_015 substitutes {pct(s['sub_rate'])} (the study's: "
                f"{pct(s['study_sub_rate'])})"
            )
        if rates:
            lines.append(f"{m}: at {100 * s['fraction']:g}% resident " + "; ".join(rates) + ".")
        u = s.get("unit_costs")
        if u and finite(s.get("copy_share")):
            us = {k: f"{1e6 * float(v):.3g} µs" for k, v in u.items() if not isinstance(v, bool)}
            bound, at_study = s["copy_free_bound"], s["copy_free_bound_at_study_rate"]
            lines.append(
                f"{m}: on {s['hardware']} a copy takes {us['copy_s']}, an expert on the fast tier "
                f"{us['expert_s']}, on the host {us['host_expert_s']}, a layer's dense work "
                f"{us['dense_layer_s']}: copies are {pct(s['copy_share'])} of fetch_every_miss's "
                f"mean layer, so a policy that copies less is at most "
                f"{bound:.2f}× faster than it ({at_study:.2f}× at the study's miss rate); "
                "host_compute's misses take "
                f"{1e6 * s['host_path_s']:.3g} µs per layer on the host beside "
                f"{1e6 * s['fast_path_s']:.3g} µs on the fast tier (mean counts)."
            )
    return lines


def plans_table(paths: list[str]) -> Table:
    """One row per plan the pipeline wrote (results/{model}/plan/{hardware}/{size}.json,
    docs/plan.md; `moesub.plan.read_plan` checks them where they are written): what a runtime
    loads for that hardware and size."""
    records = []
    for path, doc in zip(paths, load_plans(paths), strict=True):
        slots = [lp["slots"] for lp in doc["layers"]]
        pins = [len(lp["pinned"]) for lp in doc["layers"]]
        records.append(
            {
                "model": doc["model"]["name"],
                "hardware": doc["hardware"],
                "size": doc["size"]["label"],
                "policy": f"{doc['policy_name']} ({doc['choice'].replace('_', ' ')})",
                "layout": layout({"slots_per_layer": slots, "pins_per_layer": pins}),
                "tokens_per_s": (doc.get("predicted") or {}).get("tokens_per_s"),
                "files": f"{path}, {doc['pins_file']}",
            }
        )
    cols = [
        Col("model", lambda r: str(r["model"]), False),
        Col("hardware", lambda r: str(r["hardware"]), False),
        Col("size", lambda r: str(r["size"]), False),
        Col("policy (the recommendation's choice)", lambda r: str(r["policy"]), False),
        Col("slots / pinned per layer", lambda r: str(r["layout"]), False),
        Col("predicted tok/s", lambda r: num(r.get("tokens_per_s"), "{:.0f}")),
        Col("plan and pin list", lambda r: str(r["files"]), False),
    ]
    return make_table("plans-table", records, cols)
