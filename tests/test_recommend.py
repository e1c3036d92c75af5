"""moesub.recommend: the choice on hand-made tables (the split, the tie rule, the time sources),
the document's schema, the report's opening table.

Hand-made tables (`tables`) give each policy its Δppl on the screen half, the report half and
all streams, its simulator and/or engine time, and its per-stream ΔNLL; the end-to-end tests
run the real analysis on the synthetic study of tests/fixtures_artefacts.py (exact engine
times: speedups are exact ratios, Δppl % = 20 x mean mass).
"""

from __future__ import annotations

import copy
import json
import re
from html import unescape

import jsonschema
import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import CAPACITY, DPPL_PER_MASS, MASS, MODEL, TIME, make_study

from moesub.metrics import dppl_pct
from moesub.recommend import (
    INPUTS,
    RECOMMENDATION_SCHEMA,
    ModelFacts,
    RecommendParams,
    non_default_fields,
    rankings,
    recommend,
    write_recommendation,
)
from moesub.report import render_report
from moesub.stats import AnalysisParams
from moesub.stats.selection import selection, split_streams

F = 0.25
FACTS = ModelFacts(512, 10, 4, {F: ("f0.25", CAPACITY)}, {})
BASELINES = ("fetch_every_miss", "host_compute")
POLICIES = {
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "host_compute": {"rule": "host_compute", "eviction": "lru"},
    "rule_015": {"rule": "threshold", "tau": 0.15, "eviction": "lru"},
    "quality": {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5},
    "prefetch_20": {"rule": "fetch_all", "eviction": "lru", "prefetch": 20},
}


def tables(
    spec: dict[str, dict],
    bench_errors: list[float] | None = None,
    at_disk_errors: list[float] | None = None,
) -> dict:
    """One model's analysis tables at fraction F from {policy: {screen, report, all (Δppl
    upper bounds: the interval is [0, hi], the estimate hi / 2; none: not emulated), lossless
    (by construction, when not emulated), sim (seconds), engine (seconds, or (t, lo, hi)),
    streams (per-stream mean ΔNLL)}}; `bench_errors`: the engine bench's sim_rel_error,
    `at_disk_errors` its sim_rel_error_at_run_disk (default: the same)."""
    summary, halves, space, sq, pip, priced = [], [], [], [], [], []
    for name, s in spec.items():
        if "all" in s:
            summary.append({"policy": name, "fraction": F, "hit_rate": 0.7,
                            **_dppl(s["all"])})  # fmt: skip
            for half in ("screen", "report"):
                halves.append({"policy": name, "fraction": F, "half": half, **_dppl(s[half])})
            for unit, d in enumerate(s.get("streams", [0.01, 0.02, 0.01])):
                pip.append({"policy": name, "fraction": F, "level": "stream", "unit": unit,
                            "dnll_mean": d, "n_nll": 10})  # fmt: skip
        if "sim" in s:
            space.append({"policy": name, "fraction": F, "family": "study", "bound": False,
                          "lossless": s.get("lossless", False), "hit_rate": 0.8,
                          "misses_per_token": 8.0, "est_time_per_token_s": s["sim"]})  # fmt: skip
            priced.append({"hardware": "this_machine", "source": "simulator", "policy": name,
                           "fraction": F, "time_per_token_s": s["sim"]})  # fmt: skip
        if "engine" in s:
            t, lo, hi = s["engine"] if isinstance(s["engine"], tuple) else (s["engine"],) * 3
            sq.append({"policy": name, "fraction": F, "source": "engine", "device": "cpu",
                       "time_per_token_s": t, "time_ci_lo": lo, "time_ci_hi": hi})  # fmt: skip
    bench = pd.DataFrame(
        [
            {"policy": f"p{i}", "device": "cpu", "sim_rel_error": e, "sim_rel_error_at_run_disk": d}
            for i, (e, d) in enumerate(
                zip(bench_errors or [], at_disk_errors or bench_errors or [], strict=True)
            )
        ]  # fmt: skip
    )
    return {
        "summary": pd.DataFrame(summary),
        "selection": pd.DataFrame(halves),
        "design_space": pd.DataFrame(space),
        "speed_quality": pd.DataFrame(sq),
        "per_input_points": pd.DataFrame(pip),
        "priced": pd.DataFrame(priced),
        "engine_bench": bench,
    }


def _dppl(hi: float) -> dict[str, float]:
    return {"dppl_pct": hi / 2, "dppl_ci_lo": 0.0, "dppl_ci_hi": hi}


EXACT = {"screen": 0.0, "report": 0.0, "all": 0.0, "streams": [0, 0, 0]}
BASE = {"fetch_every_miss": {**EXACT, "sim": 0.030, "engine": 0.030}}


def ranked(spec, budget=1.0, bench_errors=None, policies=POLICIES) -> dict[str, dict]:
    """time source -> its ranking of `spec` at F."""
    out = rankings(tables(spec, bench_errors), policies, FACTS, BASELINES, budget)
    assert len({r["time_source"] for r in out}) == len(out)
    return {r["time_source"]: r for r in out}


def choice(r: dict, kind: str = "within_budget") -> str | None:
    return r[kind]["policy"] if r[kind] else None


# ---- the selection split ---------------------------------------------------------------------


def test_split_is_seeded_disjoint_and_covers_every_stream():
    streams = np.arange(24)
    a = split_streams(streams, seed=0)
    assert a == split_streams(streams[::-1], seed=0)  # the ids, not their order, decide
    assert len(a["screen"]) == len(a["report"]) == 12
    assert sorted(a["screen"] + a["report"]) == list(range(24))
    assert a != split_streams(streams, seed=1)
    odd = split_streams(np.arange(5), seed=0)
    assert (len(odd["screen"]), len(odd["report"])) == (3, 2)
    with pytest.raises(ValueError, match="at least 2"):
        split_streams(np.array([3]), seed=0)


def test_selection_halves_are_the_token_weighted_dppl_of_their_streams():
    # per-stream sums of a policy: stream s has 10 + s tokens with ΔNLL sum 0.01 * s
    S = 8
    per_stream = pd.DataFrame(
        {
            "name": "p",
            "fraction": F,
            "stream": np.arange(S),
            "n_nll": 10.0 + np.arange(S),
            "sum_dnll": 0.01 * np.arange(S),
        }  # fmt: skip
    )
    p = AnalysisParams(n_boot=200)
    sel = selection(per_stream, p)
    assert sel.status == {"status": "ok"}
    halves = split_streams(np.arange(S), p.seed)
    assert sel.result["screen_streams"] == halves["screen"]
    assert sel.result["report_streams"] == halves["report"]
    for half, ids in halves.items():
        (row,) = sel.table[sel.table["half"] == half].to_dict("records")
        g = per_stream[per_stream["stream"].isin(ids)]
        assert row["dppl_pct"] == pytest.approx(dppl_pct(g["sum_dnll"].sum() / g["n_nll"].sum()))
        assert row["n_streams"] == len(ids)
        assert row["dppl_ci_lo"] <= row["dppl_pct"] <= row["dppl_ci_hi"]
    one = selection(per_stream[per_stream["stream"] == 0], p)
    assert one.table.empty and "no split" in one.status["reason"]


def test_chosen_on_the_screen_half_reported_on_the_other():
    # lucky is fast and looks within budget on the screen half, but not on the report half;
    # steady is within on both. Screening on the screen half picks lucky, and the report half
    # shows what it costs where it was not chosen: best-on-screen is not best-on-report.
    spec = {
        **BASE,
        "lucky": {"screen": 0.8, "report": 2.4, "all": 1.6, "sim": 0.010},
        "steady": {"screen": 0.9, "report": 0.9, "all": 0.9, "sim": 0.015},
    }
    sim = ranked(spec)["simulator"]
    w = sim["within_budget"]
    assert w["policy"] == "lucky"
    assert (w["screen_dppl_ci_hi"], w["report_dppl_ci_hi"], w["dppl_ci_hi"]) == (0.8, 2.4, 1.6)
    assert w["report_dppl_pct"] == 1.2  # the figure the report quotes
    # screened on the report half instead, steady would have been the choice
    swapped = {n: {**s, "screen": s["report"], "report": s["screen"]} for n, s in spec.items()}
    assert choice(ranked(swapped)["simulator"]) == "steady"
    # the all-streams bound is not what qualifies a candidate: 1.6 > 1 and lucky still qualifies
    assert w["dppl_ci_hi"] > 1.0


def test_budget_boundary_counts_as_within_on_the_screen_half():
    spec = {
        **BASE,
        "at": {"screen": 1.0, "report": 5.0, "all": 3.0, "sim": 0.012},
        "over": {"screen": 1.0001, "report": 0.1, "all": 0.5, "sim": 0.010},
    }
    assert choice(ranked(spec)["simulator"]) == "at"
    assert choice(ranked(spec, budget=0.5)["simulator"]) == "fetch_every_miss"


# ---- the tie rule ----------------------------------------------------------------------------


def test_non_default_fields_count_what_differs_from_the_defaults():
    assert non_default_fields({"rule": "fetch_all", "eviction": "lru", "tau": 0.0}) == ()
    assert non_default_fields(POLICIES["quality"]) == ("rule", "tau", "eviction", "beta")
    assert non_default_fields({"rule": "fetch_all", "pin": "50%"}) == ("pin",)
    assert non_default_fields({"allocation": "planned", "pin": 0}) == ("allocation",)
    assert non_default_fields({"allocation": "uniform", "delay": 1}) == ()


def test_tie_within_the_simulator_model_error_goes_to_the_simpler_policy():
    # quality (4 non-default fields) is 5% faster than rule_015 (2 fields)
    spec = {
        **BASE,
        "rule_015": {"screen": 0.5, "report": 0.5, "all": 0.5, "sim": 0.0105},
        "quality": {"screen": 0.5, "report": 0.5, "all": 0.5, "sim": 0.0100},
    }
    # no engine bench: the pricing is deterministic and unmeasured, no tie
    plain = ranked(spec)["simulator"]
    assert choice(plain) == "quality" and plain["within_budget"]["tied"] == ["quality"]
    assert plain["timing"]["method"] == "none"
    # bench errors -3% .. +4%: ratios within 1.04 / 0.97 = 1.072 are noise: a tie
    sim = ranked(spec, bench_errors=[-0.03, 0.01, 0.04])["simulator"]
    w = sim["within_budget"]
    assert (w["policy"], w["fastest"], w["tied"]) == (
        "rule_015",
        "quality",
        ["quality", "rule_015"],
    )
    assert w["time_lo_s"] == pytest.approx(0.0105 / 1.04)
    assert w["time_hi_s"] == pytest.approx(0.0105 / 0.97)
    assert sim["timing"]["rel_error_min"] == -0.03 and sim["timing"]["rel_error_max"] == 0.04
    # errors -1% .. +1%: 1.0202 < 1.05, told apart: the faster wins
    assert choice(ranked(spec, bench_errors=[-0.01, 0.01])["simulator"]) == "quality"
    # a uniform error cancels in every ratio: no tie however large it is
    assert choice(ranked(spec, bench_errors=[-0.4, -0.4])["simulator"]) == "quality"


def test_tie_within_the_engine_median_intervals_goes_to_the_simpler_policy():
    spec = {
        **BASE,
        "rule_015": {"screen": 0.5, "report": 0.5, "all": 0.5, "engine": (0.0105, 0.0101, 0.011)},
        "quality": {"screen": 0.5, "report": 0.5, "all": 0.5, "engine": (0.0100, 0.0096, 0.0104)},
    }
    eng = ranked(spec)["engine"]
    assert choice(eng) == "rule_015" and eng["within_budget"]["fastest"] == "quality"
    assert eng["within_budget"]["speedup_vs_fetch_every_miss_lo"] == pytest.approx(0.030 / 0.011)
    spec["quality"]["engine"] = (0.0100, 0.0096, 0.0100)  # intervals apart: no tie
    assert choice(ranked(spec)["engine"]) == "quality"


# ---- time sources ----------------------------------------------------------------------------


def test_a_ranking_never_mixes_time_sources():
    spec = {
        **BASE,
        # both: a flattering simulator figure and a modest engine one
        "rule_015": {"screen": 0.5, "report": 0.5, "all": 0.5, "sim": 0.005, "engine": 0.020},
        "quality": {"screen": 0.5, "report": 0.5, "all": 0.5, "sim": 0.012},
        "host_compute": {**EXACT, "sim": 0.040, "engine": 0.045},
    }
    by = ranked(spec)
    assert set(by) == {"engine", "simulator"}
    eng = {c["policy"]: c for c in by["engine"]["candidates"]}
    sim = {c["policy"]: c for c in by["simulator"]["candidates"]}
    assert eng["rule_015"]["speedup_vs_fetch_every_miss"] == pytest.approx(0.030 / 0.020)
    assert sim["rule_015"]["speedup_vs_fetch_every_miss"] == pytest.approx(0.030 / 0.005)
    assert eng["rule_015"]["speedup_vs_host_compute"] == pytest.approx(0.045 / 0.020)
    assert sim["rule_015"]["speedup_vs_host_compute"] == pytest.approx(0.040 / 0.005)
    # quality has no engine time: not a candidate of the engine ranking, however fast
    assert eng["quality"]["excluded"] == "no engine time per token at this size"
    assert eng["quality"]["time_per_token_s"] is None
    assert (choice(by["engine"]), choice(by["simulator"])) == ("rule_015", "rule_015")
    assert by["engine"]["device"] == "cpu" and by["simulator"]["device"] is None
    assert by["simulator"]["hardware"] == by["engine"]["hardware"] == "this_machine"
    w = by["simulator"]["within_budget"]
    assert w["tokens_per_s"] == pytest.approx(1 / 0.005)
    assert w["slots_per_layer"] == [CAPACITY] * 4 and w["pins_per_layer"] == [0] * 4


def test_lossless_needs_zero_on_every_stream_or_by_construction():
    spec = {
        **BASE,
        # estimate and interval 0 would not do: one stream moved
        "almost": {"screen": 0.0, "report": 0.0, "all": 0.0, "streams": [0, 0, 1e-9], "sim": 0.01},
        # simulated only: lossless by construction, Δppl 0 exactly on every half
        "prefetch_20": {"lossless": True, "sim": 0.020},
        "lossy": {"lossless": False, "sim": 0.001},  # not emulated, not lossless: no Δppl
    }
    sim = ranked(spec)["simulator"]
    assert choice(sim, "lossless") == "prefetch_20"
    c = {c["policy"]: c for c in sim["candidates"]}
    assert c["prefetch_20"]["dppl_source"] == "exact" and c["prefetch_20"]["report_dppl_ci_hi"] == 0
    assert c["almost"]["lossless"] is False
    assert c["lossy"]["excluded"] == "no Δppl (not emulated, and not lossless by construction)"
    # the lossless one is also within any budget; it is slower than almost
    assert choice(sim) == "almost"


def test_no_candidate_gives_null_choice_with_reason():
    spec = {"a": {"screen": 2.0, "report": 2.0, "all": 2.0, "sim": 0.01, "streams": [1, 1, 1]}}
    sim = ranked(spec)["simulator"]
    assert sim["within_budget"] is None
    assert "Δppl upper CI bound on the screen half is <= 1%" in sim["within_budget_reason"]
    assert "lowest: a at 2%" in sim["within_budget_reason"]
    assert sim["lossless"] is None and "exactly 0" in sim["lossless_reason"]
    spec = {"all_resident": {**EXACT, "sim": 0.001}}
    sim = ranked(spec)["simulator"]
    assert sim["within_budget"] is sim["lossless"] is None
    assert "every expert resident" in sim["lossless_reason"]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1", True])
def test_budget_must_be_positive_number(bad):
    with pytest.raises(ValueError, match="dppl_budget_pct"):
        RecommendParams(dppl_budget_pct=bad)
    with pytest.raises(ValueError, match="unknown key"):
        RecommendParams.from_mapping({"budget": 1.0})


def test_sizes_and_per_layer_layouts_come_from_the_analysis():
    from moesub.recommend import model_facts

    # models.parquet's row (lists come back as arrays) and the simulate files' metadata
    row = {"num_experts": 512, "top_k": 10, "num_layers": 4, "fractions": np.array([75 / 512, F]),
           "sizes": np.array(["b6GiB", "f0.25"]), "capacities": np.array([75, 128])}  # fmt: skip
    layout = {"capacities": [96, 160, 128, 128], "pins": [48, 80, 0, 0]}
    provenance = [
        {"kind": "simulate", "metadata": {"name": "planned", "fraction": F, "layout": layout}},
        {"kind": "emulate", "metadata": {"name": "other", "fraction": F, "layout": layout}},
    ]
    facts = model_facts(row, provenance)
    assert facts.size(75 / 512) == ("b6GiB", 75) and facts.size(F) == ("f0.25", 128)
    assert facts.layout("other", F) == ([128] * 4, [0] * 4)  # an emulate file: not the source
    spec = {**BASE, "planned": {"screen": 0.5, "report": 0.5, "all": 0.5, "sim": 0.01}}
    sim = {r["time_source"]: r for r in rankings(tables(spec), {}, facts, BASELINES, 1.0)}
    sim = sim["simulator"]
    assert (sim["size"], sim["capacity"]) == ("f0.25", 128)
    w, ll = sim["within_budget"], sim["lossless"]
    assert (w["policy"], w["slots_per_layer"], w["pins_per_layer"]) == (
        "planned", [96, 160, 128, 128], [48, 80, 0, 0],
    )  # fmt: skip
    assert (ll["slots_per_layer"], ll["pins_per_layer"]) == ([128] * 4, [0] * 4)


# ---- end to end: the synthetic study's analysis ---------------------------------------------


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from moesub.stats import run_analysis

    root = tmp_path_factory.mktemp("recommend")
    inputs, params = make_study(root / "results")
    run_analysis(inputs, params, root / "results" / "analysis")
    a = root / "results" / "analysis"
    paths = {k: a / ("analysis.json" if k == "analysis" else f"{k}.parquet") for k in INPUTS}
    return {"root": root, "inputs": paths, "params": params}


def engine_ranking(doc: dict) -> dict:
    (r,) = [r for r in doc["rankings"] if r["time_source"] == "engine"]
    return r


def test_document_from_the_analysis_outputs(study, tmp_path):
    # budget 3.5%: rule_tau0.08 (Δppl 20 x 0.12 = 2.4%, the smallest after the lossless ones)
    out = tmp_path / MODEL / "recommendation.json"
    doc = write_recommendation(study["inputs"], MODEL, {"dppl_budget_pct": 3.5}, out)
    assert json.loads(out.read_text()) == doc
    jsonschema.validate(doc, RECOMMENDATION_SCHEMA)
    assert (doc["model"], doc["baseline"], doc["host_baseline"], doc["dppl_budget_pct"]) == (
        MODEL,
        "fetch_every_miss",
        "host_compute",
        3.5,
    )
    split = doc["selection"]
    assert sorted(split["screen_streams"] + split["report_streams"]) == list(
        range(split["n_streams"])
    )
    assert {r["time_source"] for r in doc["rankings"]} == {"engine", "simulator"}
    r = engine_ranking(doc)
    assert (r["size"], r["fraction"], r["capacity"], r["device"]) == (
        "f0.25",
        0.25,
        CAPACITY,
        "cpu",
    )
    w = r["within_budget"]
    assert w["policy"] == "rule_tau0.08" and r["within_budget_reason"] is None
    assert w["dppl_pct"] == pytest.approx(DPPL_PER_MASS * MASS["rule_tau0.08"])
    assert w["screen_dppl_ci_hi"] <= 3.5
    assert w["time_per_token_s"] == pytest.approx(TIME["rule_tau0.08"])
    assert w["speedup_vs_fetch_every_miss"] == pytest.approx(
        TIME["fetch_every_miss"] / TIME["rule_tau0.08"]
    )
    assert w["speedup_vs_host_compute"] == pytest.approx(
        TIME["host_compute"] / TIME["rule_tau0.08"]
    )
    assert r["lossless"]["policy"] == "fetch_every_miss" and r["lossless"]["lossless"] is True
    considered = {c["policy"]: c for c in r["candidates"]}
    assert set(considered) == set(study["params"]["policies"])
    assert considered["host_compute"]["lossless"] is True
    assert considered["rule_015"]["lossless"] is False
    # the default budget (1%): only the lossless policies are within it
    default = recommend(study["inputs"], MODEL, {})
    assert default["dppl_budget_pct"] == 1.0
    assert engine_ranking(default)["within_budget"]["policy"] == "fetch_every_miss"


def test_schema_rejects_malformed_documents(study):
    doc = recommend(study["inputs"], MODEL, {})
    for edit in (
        lambda d: d.pop("dppl_budget_pct"),
        lambda d: d.pop("selection"),
        lambda d: d["rankings"][0].pop("lossless_reason"),
        lambda d: d["rankings"][0].update(time_source="guess"),
        lambda d: d["rankings"][0]["within_budget"].pop("report_dppl_ci_hi"),
        lambda d: d["rankings"][0]["within_budget"].update(slots_per_layer=[-1]),
        lambda d: d["rankings"][0]["candidates"][0].pop("hit_rate"),
    ):
        bad = copy.deepcopy(doc)
        edit(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, RECOMMENDATION_SCHEMA)


def test_missing_inputs_are_named(study, tmp_path):
    with pytest.raises(ValueError, match=r"inputs lack \['models'\]"):
        recommend({k: v for k, v in study["inputs"].items() if k != "models"}, MODEL, {})
    with pytest.raises(FileNotFoundError, match="inputs\\['summary'\\]"):
        recommend({**study["inputs"], "summary": tmp_path / "none.parquet"}, MODEL, {})
    with pytest.raises(ValueError, match="model 'other' is not in"):
        recommend(study["inputs"], "other", {})


def table_rows(html: str, table_id: str) -> list[list[str]]:
    body = re.search(rf'<table id="{table_id}">.*?<tbody>(.*?)</tbody>', html, re.S).group(1)
    return [
        [unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


def test_report_opens_with_the_recommendation_table(study, tmp_path):
    rec = tmp_path / "recommendation.json"
    doc = write_recommendation(study["inputs"], MODEL, {"dppl_budget_pct": 3.5}, rec)
    html = render_report(
        study["inputs"]["analysis"].parent, {}, tmp_path / "report.html", recommendations=[rec]
    ).read_text()
    # the first section after the title is the recommendation, and it opens with the table
    assert re.findall(r"<h2 id=\"([^\"]+)\"", html)[0] == "recommendation"
    section = html[html.index('id="recommendation"') : html.index('id="headline"')]
    assert section.index('id="recommendation-table"') < section.index("<li>")
    rows = table_rows(html, "recommendation-table")
    r = engine_ranking(doc)
    w = r["within_budget"]
    assert rows[0][:8] == [
        "this_machine", f"f0.25 (C = {CAPACITY})", "engine (cpu)", "rule_tau0.08",
        f"{CAPACITY} × 4 layers / none pinned", f"{1 / TIME['rule_tau0.08']:.3g}", "1.67×",
        "2.50×",
    ]  # fmt: skip
    lo, hi = w["report_dppl_ci_lo"], w["report_dppl_ci_hi"]
    assert rows[0][9] == f"{w['report_dppl_pct']:+.2f} [{lo:+.2f}, {hi:+.2f}]"
    assert rows[0][11:] == [
        "fetch_every_miss",
        f"{1 / TIME['fetch_every_miss']:.3g}",
        "1.00× / 1.50×",
    ]
    assert [row[2] for row in rows] == ["engine (cpu)", "simulator"]
    items = [unescape(i) for i in re.findall(r"<li>(.*?)</li>", section, re.S)]
    s = doc["selection"]
    assert items[0].startswith(
        f"{MODEL}: candidates screened on {len(s['screen_streams'])} of the {s['n_streams']} "
        "evaluation streams"
    )
    with pytest.raises(FileNotFoundError, match="rule recommend"):
        render_report(
            study["inputs"]["analysis"].parent,
            {},
            tmp_path / "r1.html",
            recommendations=[tmp_path / "absent.json"],
        )


def test_report_table_has_one_row_per_hardware_size_and_source():
    from moesub.report.recommendation import recommendation_lines, recommendation_table

    def ranking(hardware, size, source, policy, t, fastest=None):
        c = {"policy": policy, "time_per_token_s": t, "time_lo_s": t, "time_hi_s": t,
             "speedup_vs_fetch_every_miss": 0.03 / t, "slots_per_layer": [96, 160],
             "pins_per_layer": [0, 0], "fastest": fastest or policy, "tied": [policy],
             "non_default_fields": ["rule", "tau"]}  # fmt: skip
        if fastest:
            c["tied"] = sorted([policy, fastest])
        return {"hardware": hardware, "size": size, "capacity": 128, "time_source": source,
                "device": "cpu" if source == "engine" else None, "within_budget": c,
                "lossless": None, "lossless_reason": "no candidate is lossless",
                "timing": {"text": f"{source} timing"}}  # fmt: skip

    doc = {"model": "m", "dppl_budget_pct": 1.0, "selection": None, "rankings": [
        ranking("rtx3090", "b6GiB", "simulator", "rule_015", 0.02),
        ranking("rtx3090", "b10GiB", "simulator", "rule_015", 0.01, fastest="quality"),
        ranking("h100", "b6GiB", "simulator", "speed", 0.005),
        ranking("this_machine", "b6GiB", "engine", "speed", 0.05),
    ]}  # fmt: skip
    t = recommendation_table([doc], "95% CI")
    assert [r[:4] for r in t.rows] == [
        ["rtx3090", "b6GiB (C = 128)", "simulator", "rule_015"],
        ["rtx3090", "b10GiB (C = 128)", "simulator", "rule_015"],
        ["h100", "b6GiB (C = 128)", "simulator", "speed"],
        ["this_machine", "b6GiB (C = 128)", "engine (cpu)", "speed"],
    ]
    assert t.rows[0][4] == "96-160 (mean 128) / none pinned"
    assert t.rows[0][5:7] == ["50", "1.50×"]
    assert t.rows[0][11] == "none (see below)"
    lines = recommendation_lines([doc], "95% CI")
    assert "m: no split of the streams; nothing could be screened." in lines
    assert "m: engine timing." in lines and "m: simulator timing." in lines
    assert (
        "m, rtx3090, b10GiB, simulator: within budget: quality is the fastest; rule_015 is within "
        "its timing noise, and rule_015 has the fewest non-default fields (rule, tau): chosen."
    ) in lines
    assert "m, h100, b6GiB, simulator: no lossless choice: no candidate is lossless." in lines


# ---- against the study's table ---------------------------------------------------------------


def test_study_comparison_quotes_the_study_profile_ranking_and_says_why():
    from moesub.hardware import PROFILES, STUDY_PROFILE, reference_model_bytes
    from moesub.recommend.study import study_comparison
    from moesub.report.recommendation import against_study, study_lines

    spec = {
        **BASE,
        "quality": {"screen": 0.5, "report": 0.5, "all": 0.5, "sim": 0.012},
        "speed": {"screen": 0.6, "report": 0.6, "all": 0.6, "sim": 0.011},
        "rule_015": {"screen": 0.4, "report": 0.4, "all": 0.4, "sim": 0.013},
        "host_compute": {**EXACT, "sim": 0.026},
    }
    t = tables(spec)
    t["summary"]["sim_sub_rate"] = [0.0, 0.05, 0.06, 0.04, 0.0]  # spec order
    (r,) = [x for x in rankings(t, POLICIES, FACTS, BASELINES, 1.0) if x["device"] is None]
    other = copy.deepcopy(r) | {"hardware": "rtx5090_pcie5_ddr5"}
    study = {**copy.deepcopy(r), "hardware": STUDY_PROFILE}
    costs = PROFILES[STUDY_PROFILE].price(reference_model_bytes(4.5))
    s = study_comparison([other, study], costs, top_k=10)
    got = {(c["policy"], c["reference"]): c["speedup"] for c in s["comparisons"]}
    assert got == {
        ("quality", "fetch_every_miss"): pytest.approx(0.030 / 0.012),
        ("speed", "fetch_every_miss"): pytest.approx(0.030 / 0.011),
        ("rule_015", "host_compute"): pytest.approx(0.026 / 0.013),
    }
    assert s["priced"] and s["size"] == "f0.25"
    # this run's rates, the simulator's: fetch_every_miss hits 0.8, rule_015 substitutes 4%
    assert s["miss_rate"] == pytest.approx(0.2) and s["sub_rate"] == 0.04
    # where the time goes, by hand: m = 2 misses per token-layer
    d, e, c, h = costs.dense_layer_s, costs.expert_s, costs.copy_s, costs.host_expert_s
    assert s["fetch_layer_s"] == pytest.approx(d + 10 * e + 2 * c)
    assert s["copy_share"] == pytest.approx(2 * c / (d + 10 * e + 2 * c))
    assert s["copy_free_bound"] == pytest.approx((d + 10 * e + 2 * c) / (d + 10 * e))
    assert s["copy_free_bound_at_study_rate"] == pytest.approx(
        (d + 10 * e + 0.85 * c) / (d + 10 * e)
    )
    assert s["host_layer_s"] == pytest.approx(d + max(2 * h, 8 * e))  # concurrent host
    lines = study_lines([{"model": "m", "study": s}])
    assert lines[0] == (
        f"m: quality vs fetch_every_miss on {STUDY_PROFILE} at 25% resident: 2.50× "
        "(simulator); the study measured 2.5-3×: the interval reaches the study's range, "
        "consistent with it."
    )
    assert lines[2].endswith("2.8-3×: the interval lies below the study's range, against it.")
    above = {"speedup": 3.4, "speedup_lo": 3.1, "speedup_hi": 3.8, "study_low": 2.5,
             "study_high": 3.0}  # fmt: skip
    assert against_study(above) == "the interval lies above the study's range, against it"
    assert "reaches" in against_study(above | {"speedup_lo": 2.9})
    assert "misses 20.0% of expert calls (the study's cache: 8.5%)" in lines[3]
    assert "rule_015 substitutes 4.0% (the study's: 7.5%)" in lines[3]
    assert f"a copy takes {1e6 * c:.3g} µs" in lines[4]
    # without the study profile's ranking: no prediction, the rates still
    s = study_comparison([other], None, top_k=10)
    assert not s["priced"] and all(c["speedup"] is None for c in s["comparisons"])
    assert s["miss_rate"] == pytest.approx(0.2) and s["unit_costs"] is None
    lines = study_lines([{"model": "m", "study": s}])
    assert lines[0].startswith(f"m: {STUDY_PROFILE} at 25% resident: no prediction")


def test_one_ranking_per_priced_hardware_none_mixing_sources():
    """Each priced profile is a simulator ranking of its own (its times only); a documented
    profile's interval says it is an estimate and is the bench's error at each run's disk
    speed (the pricing's own), this machine's is the bench's error as measured."""
    spec = {**BASE, "quality": {"screen": 0.2, "report": 0.3, "all": 0.3, "sim": 0.010,
                                "engine": 0.012}}  # fmt: skip
    t = tables(spec, bench_errors=[-0.05, 0.05], at_disk_errors=[-0.02, 0.01])
    gpu = t["priced"].assign(hardware="rtx3090_pcie4_ddr4",
                             time_per_token_s=t["priced"]["time_per_token_s"] / 10)  # fmt: skip
    t["priced"] = pd.concat([t["priced"], gpu], ignore_index=True)
    out = rankings(t, POLICIES, FACTS, BASELINES, 1.0)
    keys = sorted((r["hardware"], r["time_source"]) for r in out)
    assert keys == [("rtx3090_pcie4_ddr4", "simulator"), ("this_machine", "engine"),
                    ("this_machine", "simulator")]  # fmt: skip
    by = {(r["hardware"], r["time_source"]): r for r in out}
    gpu_pick = by[("rtx3090_pcie4_ddr4", "simulator")]["within_budget"]
    assert gpu_pick["policy"] == "quality"
    assert gpu_pick["time_per_token_s"] == pytest.approx(0.001)
    gpu_timing = by[("rtx3090_pcie4_ddr4", "simulator")]["timing"]
    assert (
        "profile estimate" in gpu_timing["method"] and "at its disk's speed" in gpu_timing["text"]
    )
    assert (gpu_timing["rel_error_min"], gpu_timing["rel_error_max"]) == (-0.02, 0.01)
    own = by[("this_machine", "simulator")]["timing"]
    assert own["method"] == "simulator model error" and "(as measured)" in own["text"]
    assert (own["rel_error_min"], own["rel_error_max"]) == (-0.05, 0.05)


# ---- a model given as a router trace ---------------------------------------------------------


def test_trace_model_ranking_has_the_fastest_policy_with_the_mass_proxy():
    """A trace model (no Δppl): no within-budget choice; `fastest` is the fastest runnable
    policy with its substituted mass, the labelled proxy; lossless as any model's (Δppl 0 by
    construction); r from another model's mass hypothesis (one with an r, the nearest
    fraction first)."""
    from moesub.hardware import STUDY_PROFILE
    from moesub.recommend.trace import NO_DPPL, mass_proxy

    spec = {  # simulated only (no Δppl): policy -> seconds, lossless by construction
        "fetch_every_miss": {"sim": 0.010, "lossless": True},
        "host_compute": {"sim": 0.008, "lossless": True},
        "rule_015": {"sim": 0.005},
    }
    t = tables(spec)
    t["priced"]["hardware"] = STUDY_PROFILE  # a trace model has no this_machine
    mass = {"fetch_every_miss": 0.0, "host_compute": 0.0, "rule_015": 0.03}
    t["summary"] = pd.DataFrame(
        [{"policy": p, "fraction": F, "sim_mass_mean": m} for p, m in mass.items()]
    )
    analysis = {
        "mass_hypothesis": [
            {"model": "other", "fraction": 0.5, "r": 0.9, "n": 6},
            {"model": "other", "fraction": 0.25, "r": None, "n": 2, "reason": "too few"},
            {"model": "traced", "fraction": 0.25, "r": 0.1, "n": 6},
        ],
    }
    proxy = lambda f: mass_proxy(analysis, "traced", f)  # noqa: E731
    (r,) = rankings(t, POLICIES, FACTS, BASELINES, 1.0, proxy)
    assert r["hardware"] == STUDY_PROFILE and r["time_source"] == "simulator"
    assert r["within_budget"] is None and r["within_budget_reason"] == NO_DPPL
    fastest = r["fastest"]
    assert fastest["policy"] == "rule_015" and fastest["dppl_pct"] is None
    assert fastest["speedup_vs_fetch_every_miss"] == pytest.approx(2)
    assert fastest["substituted_mass"] == 0.03
    assert r["lossless"]["policy"] == "host_compute"
    p = r["quality_proxy"]
    assert (p["r"], p["from_model"], p["from_fraction"]) == (0.9, "other", 0.5)
    assert p["label"].startswith("quality proxy")
    # a model with Δppl: no fastest, no proxy
    (plain,) = rankings(t, POLICIES, FACTS, BASELINES, 1.0)
    assert "fastest" not in plain and "quality_proxy" not in plain
