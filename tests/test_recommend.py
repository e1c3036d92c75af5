"""moesub.recommend: the choice on hand-made frames, the document's schema, the report's opening.

Hand-made frames (`frames`) give each policy its Δppl upper CI bound, an engine and/or simulator
speedup vs fetch_every_miss and its per-stream mean ΔNLL; the end-to-end tests run the real
analysis on the synthetic study of tests/fixtures_artefacts.py (exact engine times: speedups
are exact ratios, Δppl % = 20 x mean mass).
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

from moesub.recommend import (
    INPUTS,
    RECOMMENDATION_SCHEMA,
    RecommendParams,
    candidates,
    choose,
    recommend,
    write_recommendation,
)
from moesub.report import render_report

F = 0.25
CALLS = 40  # k * L


def frames(spec: dict[str, dict]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(summary, speed_quality, per_input_points) at fraction F from {policy: {hi, engine,
    sim, streams}}: Δppl upper bound, engine / simulator speedup (None: not run there) and the
    per-stream mean ΔNLL (default: 0.01 on each of 3 streams)."""
    summary, sq, pip = [], [], []
    for name, s in spec.items():
        eng = s.get("engine")
        summary.append(
            {
                "model": MODEL,
                "policy": name,
                "fraction": F,
                "dppl_pct": s["hi"] / 2,
                "dppl_ci_lo": 0.0,
                "dppl_ci_hi": s["hi"],
                "hit_rate": 0.75,
                "engine_device": "cpu" if eng is not None else None,
                "time_per_token_s": 0.01 / eng if eng is not None else np.nan,
                "speedup_vs_fetch_every_miss": eng if eng is not None else np.nan,
            }
        )
        if s.get("sim") is not None:
            sq.append(
                {
                    "model": MODEL,
                    "policy": name,
                    "fraction": F,
                    "source": "simulate",
                    "device": "simulated",
                    "time_per_token_s": 0.008 / s["sim"],
                    "speedup_vs_fetch_every_miss": s["sim"],
                }
            )
        for unit, d in enumerate(s.get("streams", [0.01, 0.01, 0.01])):
            pip.append(
                {
                    "model": MODEL,
                    "policy": name,
                    "fraction": F,
                    "level": "stream",
                    "unit": unit,
                    "dnll_mean": d,
                    "n_nll": 10,
                }
            )
    return pd.DataFrame(summary), pd.DataFrame(sq), pd.DataFrame(pip)


BASE = {"fetch_every_miss": {"hi": 0.0, "engine": 1.0, "sim": 1.0, "streams": [0, 0, 0]}}


def pick(spec: dict[str, dict], budget: float = 1.0) -> dict:
    cands = candidates(*frames(spec), F, CALLS)
    return {
        k: (row["policy"] if row else None, why) for k, (row, why) in choose(cands, budget).items()
    }


def test_budget_boundary_counts_as_within():
    spec = {**BASE, "at": {"hi": 1.0, "engine": 1.2}, "over": {"hi": 1.0001, "engine": 1.5}}
    assert pick(spec)["within_budget"] == ("at", None)
    # a smaller budget leaves only the baseline
    assert pick(spec, budget=0.5)["within_budget"] == ("fetch_every_miss", None)


def test_engine_time_preferred_over_simulator():
    # both has an engine and a (flattering) simulator speedup: its engine figure counts
    spec = {
        **BASE,
        "both": {"hi": 0.5, "engine": 1.1, "sim": 1.9},
        "sim_only": {"hi": 0.5, "sim": 1.2},
    }
    cands = candidates(*frames(spec), F, CALLS).set_index("policy")
    assert cands.loc["both", "time_source"] == "engine"
    assert cands.loc["both", "speedup_vs_fetch_every_miss"] == 1.1
    assert cands.loc["both", "time_per_token_s"] == pytest.approx(0.01 / 1.1)
    assert cands.loc["sim_only", "time_source"] == "simulator"
    assert cands.loc["sim_only", "device"] is None
    assert pick(spec)["within_budget"] == ("sim_only", None)
    # without the engine run, the simulator's figure is used
    spec["both"] = {"hi": 0.5, "sim": 1.9}
    assert pick(spec)["within_budget"] == ("both", None)


def test_lossless_choice_needs_zero_on_every_stream():
    spec = {
        **BASE,
        "host": {"hi": 0.0, "engine": 0.8, "streams": [0, 0, 0]},
        # estimate and interval 0 would not do: one stream moved
        "almost": {"hi": 0.0, "engine": 1.3, "streams": [0, 0, 1e-9]},
        "lossy": {"hi": 0.2, "engine": 1.5},
    }
    got = pick(spec)
    assert got["lossless"] == ("fetch_every_miss", None)
    assert got["within_budget"] == ("lossy", None)
    spec["fetch_every_miss"]["streams"] = [0, 1e-9, 0]  # (not a real baseline: exercise the rule)
    assert pick(spec)["lossless"] == ("host", None)
    cands = candidates(*frames(spec), F, CALLS).set_index("policy")
    assert cands.loc["host", "misses_per_token"] == pytest.approx(CALLS * 0.25)


def test_no_candidate_gives_null_choice_with_reason():
    spec = {"a": {"hi": 2.0, "engine": 1.2}, "b": {"hi": 1.5, "sim": 1.4}}
    got = pick(spec)
    assert got["within_budget"][0] is None
    assert "no candidate's Δppl upper CI bound is <= 1%" in got["within_budget"][1]
    assert "lowest: b at 1.5%" in got["within_budget"][1]
    assert got["lossless"] == (None, "no candidate has Δppl exactly 0 on every stream")
    # no time anywhere, all_resident never: both null, the reasons named
    spec = {"a": {"hi": 0.5}, "all_resident": {"hi": 0.0, "engine": 2.0, "streams": [0, 0, 0]}}
    got = pick(spec)
    assert got["within_budget"] == got["lossless"]
    assert got["lossless"][0] is None
    assert "no time per token" in got["lossless"][1]
    assert "every expert resident" in got["lossless"][1]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1", True])
def test_budget_must_be_positive_number(bad):
    with pytest.raises(ValueError, match="dppl_budget_pct"):
        RecommendParams(dppl_budget_pct=bad)
    with pytest.raises(ValueError, match="unknown key"):
        RecommendParams.from_mapping({"budget": 1.0})


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


def within_choice(doc: dict) -> dict:
    (entry,) = doc["fractions"]
    return entry


def test_document_from_the_analysis_outputs(study, tmp_path):
    # budget 3.5%: rule_tau0.08 (Δppl 20 x 0.12 = 2.4%, the smallest after the lossless ones)
    out = tmp_path / MODEL / "recommendation.json"
    doc = write_recommendation(study["inputs"], MODEL, {"dppl_budget_pct": 3.5}, out)
    assert json.loads(out.read_text()) == doc
    jsonschema.validate(doc, RECOMMENDATION_SCHEMA)
    assert (doc["model"], doc["baseline"], doc["dppl_budget_pct"]) == (
        MODEL,
        "fetch_every_miss",
        3.5,
    )
    entry = within_choice(doc)
    assert (entry["fraction"], entry["capacity"]) == (0.25, CAPACITY)
    w = entry["within_budget"]
    assert w["policy"] == "rule_tau0.08" and entry["within_budget_reason"] is None
    assert w["dppl_pct"] == pytest.approx(DPPL_PER_MASS * MASS["rule_tau0.08"])
    assert 2.4 < w["dppl_ci_hi"] <= 3.5
    assert (w["time_source"], w["device"]) == ("engine", "cpu")
    assert w["time_per_token_s"] == pytest.approx(TIME["rule_tau0.08"])
    assert w["speedup_vs_fetch_every_miss"] == pytest.approx(
        TIME["fetch_every_miss"] / TIME["rule_tau0.08"]
    )
    assert entry["lossless"]["policy"] == "fetch_every_miss"
    assert entry["lossless"]["lossless"] is True
    considered = {c["policy"]: c for c in entry["candidates"]}
    assert set(considered) == set(study["params"]["policies"])
    assert considered["host_compute"]["lossless"] is True
    assert considered["rule_015"]["lossless"] is False
    # the default budget (1%): only the lossless policies are within it
    default = recommend(study["inputs"], MODEL, {})
    assert default["dppl_budget_pct"] == 1.0
    assert within_choice(default)["within_budget"]["policy"] == "fetch_every_miss"


def test_schema_rejects_malformed_documents(study):
    doc = recommend(study["inputs"], MODEL, {})
    for edit in (
        lambda d: d.pop("dppl_budget_pct"),
        lambda d: d["fractions"][0].pop("lossless_reason"),
        lambda d: d["fractions"][0]["within_budget"].update(time_source="guess"),
        lambda d: d["fractions"][0]["candidates"][0].pop("hit_rate"),
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


def test_report_opens_with_the_recommendation(study, tmp_path):
    rec = tmp_path / "recommendation.json"
    doc = write_recommendation(study["inputs"], MODEL, {"dppl_budget_pct": 3.5}, rec)
    html = render_report(
        study["inputs"]["analysis"].parent, {}, tmp_path / "report.html", recommendations=[rec]
    ).read_text()
    # the first section after the title is the recommendation
    assert re.findall(r"<h2 id=\"([^\"]+)\"", html)[0] == "recommendation"
    first = unescape(re.search(r"<li>(.*?)</li>", html, re.S).group(1))
    w = within_choice(doc)["within_budget"]
    expected = (
        f"{MODEL}: at 25% resident (C = {CAPACITY}) use rule_tau0.08: 1.67× faster than "
        "fetch_every_miss (engine on cpu, 18 ms per token) at +2.40% perplexity "
        f"[{w['dppl_ci_lo']:+.2f}, {w['dppl_ci_hi']:+.2f}] (95% CI); lossless: "
        "fetch_every_miss itself (engine on cpu, 30 ms per token)."
    )
    assert first == expected
    with pytest.raises(FileNotFoundError, match="rule recommend"):
        render_report(
            study["inputs"]["analysis"].parent,
            {},
            tmp_path / "r1.html",
            recommendations=[tmp_path / "absent.json"],
        )
    # no candidate within the budget: the sentence says so
    none = tmp_path / "none.json"
    doc["fractions"][0].update(within_budget=None, within_budget_reason="no candidate: x")
    none.write_text(json.dumps(doc))
    html = render_report(
        study["inputs"]["analysis"].parent, {}, tmp_path / "r2.html", recommendations=[none]
    ).read_text()
    first = unescape(re.search(r"<li>(.*?)</li>", html, re.S).group(1))
    assert first.startswith(
        f"{MODEL}: at 25% resident (C = {CAPACITY}) no policy is within the 3.5% perplexity "
        "budget: no candidate: x; lossless: fetch_every_miss itself"
    )


def test_trace_model_recommendation_uses_simulate_and_the_mass_proxy():
    """A trace model (no Δppl): the fastest simulated policy on the study profile (not another
    priced one) with its substituted mass, the
    fastest that substitutes nothing as lossless, r taken from another model's mass hypothesis
    (the one with an r, then the nearest fraction)."""
    from moesub.hardware import STUDY_PROFILE
    from moesub.recommend import trace_recommendation

    rows = [  # policy, simulated time on the study profile, sub rate, mass
        ("fetch_every_miss", 0.010, 0.0, 0.0),
        ("host_compute", 0.008, 0.0, 0.0),
        ("rule_015", 0.005, 0.2, 0.03),
    ]
    summary = pd.DataFrame(
        [
            {"policy": p, "fraction": F, "sim_hit_rate": 0.5, "sim_sub_rate": sub,
             "sim_mass_mean": m}
            for p, _, sub, m in rows
        ]
    )  # fmt: skip
    # priced on the study profile and on another one, whose times would pick host_compute
    other = {"host_compute": 0.1}  # time factor on a_profile
    priced = pd.DataFrame(
        [
            {"hardware": hw, "source": "simulator", "policy": p, "fraction": F,
             "time_per_token_s": t * (1 if hw == STUDY_PROFILE else other.get(p, 1))}
            for hw in ("a_profile", STUDY_PROFILE)
            for p, t, _, _ in rows
        ]
    )  # fmt: skip
    analysis = {
        "params": {"baseline": "fetch_every_miss"},
        "mass_hypothesis": [
            {"model": "other", "fraction": 0.5, "r": 0.9, "n": 6},
            {"model": "other", "fraction": 0.25, "r": None, "n": 2, "reason": "too few"},
            {"model": "traced", "fraction": 0.25, "r": 0.1, "n": 6},
        ],
    }
    geometry = {"num_experts": 64, "top_k": 4, "num_layers": 10}
    doc = trace_recommendation(
        "traced", geometry, summary, priced, [F], analysis, RecommendParams()
    )
    (e,) = doc["fractions"]
    assert doc["source"] == "trace" and doc["hardware"] == STUDY_PROFILE
    assert e["within_budget"] is None
    assert e["fastest"]["policy"] == "rule_015" and e["fastest"]["speedup_vs_fetch_every_miss"] == 2
    assert e["fastest"]["substituted_mass"] == 0.03 and e["fastest"]["dppl_pct"] is None
    assert e["lossless"]["policy"] == "host_compute"
    proxy = e["quality_proxy"]
    assert (proxy["r"], proxy["from_model"], proxy["from_fraction"]) == (0.9, "other", 0.5)
    assert proxy["label"].startswith("quality proxy")
    jsonschema.validate(doc, RECOMMENDATION_SCHEMA)
