"""moesub.stats.expb: Experiment B's decision rules, effect, interval and power figures."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import make_study
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from moesub.io import write_parquet
from moesub.stats import run_analysis
from moesub.stats.expb import decide, hodges_lehmann, signed_rank_cdf
from moesub.stats.params import DesignRule, ExpBRule

MATCHED = DesignRule("matched", primary=0.2, max_gap=0.05, min_realized_fraction=0.9)
STUDY = DesignRule("study", primary=0.2, max_gap=0.10, min_heavy_fraction=0.5)


# --------------------------------------------------------------------------- the decision rule
def test_matched_validity_boundaries():
    d = np.linspace(0.1, 1.0, 10)  # every difference positive: p = 2^-10
    ok = decide(MATCHED, 0.2, 0.19, 0.19 * 1.05, d, alpha=0.05)
    assert ok["valid"] and ok["outcome"] == "heavy worse"
    assert ok["p_value"] == pytest.approx(2.0**-10)
    gap = decide(MATCHED, 0.2, 0.19, 0.19 * 1.051, d, alpha=0.05)
    assert not gap["valid"] and gap["outcome"] == "invalid" and gap["p_value"] is None
    assert "differ by 5.1% > 5%" in gap["outcome_text"]
    low = decide(MATCHED, 0.2, 0.1799, 0.18, d, alpha=0.05)  # 0.1799 < 90% of 0.2
    assert not low["valid"] and "< 90% of m* 0.2" in low["outcome_text"]
    assert decide(MATCHED, 0.2, 0.18, 0.18, d, alpha=0.05)["valid"]  # exactly 90%: valid


def test_a_condition_without_mass_is_said_so():
    out = decide(MATCHED, 0.2, 0.19, 0.0, np.ones(6), alpha=0.05)
    assert not out["valid"] and "a condition realized no mass" in out["outcome_text"]
    assert "inf" not in out["outcome_text"]


def test_study_rule_is_the_studys():
    d = np.ones(6)
    # light realizing far less than heavy is invalid under both rules; heavy at 50% of m* passes
    assert decide(STUDY, 0.2, 0.1, 0.105, d, 0.05)["valid"]
    assert not decide(STUDY, 0.2, 0.099, 0.099, d, 0.05)["valid"]
    assert not decide(STUDY, 0.2, 0.2, 0.002, d, 0.05)["valid"]


def test_heavy_not_worse_and_the_floor_of_p():
    d = np.array([0.3, -0.1, 0.2, 0.1])
    out = decide(MATCHED, 0.2, 0.2, 0.2, d, alpha=0.05)
    assert out["outcome"] == "heavy not worse" and out["p_value"] >= 1 / 16
    assert "p cannot go below 0.0625 with 4 non-zero differences" in out["outcome_text"]
    zeros = decide(MATCHED, 0.2, 0.2, 0.2, np.zeros(5), alpha=0.05)
    assert zeros["outcome"] == "heavy not worse" and zeros["p_value"] == 1.0
    assert decide(MATCHED, 0.2, 0.2, 0.2, np.zeros(0), 0.05)["outcome"] == "invalid"


def test_rule_from_config():
    spec = {"alpha": 0.01, "designs": {"matched": {"primary": 0.02, "heavy_mass": 0.12}}}
    rule = ExpBRule.from_mapping(spec)
    assert rule.alpha == 0.01 and rule.designs["matched"].max_gap == 0.05
    assert rule.designs["matched"].min_realized_fraction == 0.9
    with pytest.raises(ValueError, match="unknown design"):
        ExpBRule.from_mapping({"designs": {"other": {"primary": 0.1}}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['min_heavy_fraction'\]"):
        ExpBRule.from_mapping({"designs": {"matched": {"primary": 0.1, "min_heavy_fraction": 1}}})
    with pytest.raises(ValueError, match="primary"):
        ExpBRule.from_mapping({"designs": {"study": {}}})


# --------------------------------------------------------------------------- effect and interval
def test_signed_rank_cdf_against_enumeration():
    for n in (1, 3, 6):
        sums = [
            sum(r for r, s in zip(range(1, n + 1), signs, strict=True) if s)
            for signs in itertools.product([0, 1], repeat=n)
        ]
        brute = np.array([np.mean(np.array(sums) <= t) for t in range(n * (n + 1) // 2 + 1)])
        np.testing.assert_allclose(signed_rank_cdf(n), brute, rtol=0, atol=1e-15)


@settings(max_examples=60, deadline=None)
@given(st.integers(6, 30), st.integers(0, 2**31 - 1))
def test_hodges_lehmann_interval_is_the_inverted_test(n, seed):
    """The interval holds exactly the shifts the two-sided exact test does not reject."""
    d = np.random.default_rng(seed).normal(0.3, 1.0, n)
    est, lo, hi = hodges_lehmann(d, 0.9)
    i, j = np.triu_indices(n)
    assert est == pytest.approx(np.median((d[i] + d[j]) / 2))
    if lo is None:
        return
    assert lo <= est <= hi
    for shift, inside in (
        (lo - 1e-9, False),
        (lo + 1e-9, True),
        (hi - 1e-9, True),
        (hi + 1e-9, False),
    ):
        p = sps.wilcoxon(d - shift, alternative="two-sided", method="exact").pvalue
        assert (p > 0.1 - 1e-12) == inside, (shift, p)


def test_hodges_lehmann_too_few_streams():
    est, lo, hi = hodges_lehmann(np.array([1.0, 2.0, 3.0]), 0.95)  # 2 * 2^-3 > 5%: no interval
    assert est == 2.0 and lo is None and hi is None


# --------------------------------------------------------------------------- the analysis part
@pytest.mark.parametrize(
    ("case", "outcome"),
    [
        ("heavy_worse", "heavy worse"),
        ("no_evidence", "heavy not worse"),
        ("invalid_mass", "invalid"),
        ("invalid_gap", "invalid"),
    ],
)
def test_experiment_b_outcomes(tmp_path, case, outcome):
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss"], expb_case=case)
    feasibility = pd.DataFrame(
        {"heavy_mass": [0.1, 0.15], "configured": [False, True], "support": [0.2, 0.3],
         "max_target": [0.02, 0.045]}
    )  # fmt: skip
    inputs["expb_feasibility"] = [
        str(write_parquet(feasibility, tmp_path / "r" / "tiny" / "expb" / "feasibility.parquet"))
    ]
    doc = run_analysis(inputs, params, tmp_path / "an")
    by_design = {e["design"]: e for e in doc["expb"]}
    assert set(by_design) == {"study", "matched"}
    dec = by_design["matched"]["decision"]
    assert dec["target_mass"] == pytest.approx(0.2) and dec["primary"]
    assert dec["outcome"] == outcome and dec["outcome_text"].startswith(outcome)
    if outcome == "heavy worse":
        assert dec["p_value"] == pytest.approx(0.5**8)  # every one of 8 streams has d > 0
        assert dec["effect"] > 0 and dec["effect_ci_lo"] > 0 and dec["valid"]
    elif outcome == "heavy not worse":
        assert dec["p_value"] == pytest.approx(1.0) and dec["valid"] and dec["effect"] < 0
    else:
        assert not dec["valid"] and dec["p_value"] is None
    assert dec["min_p"] == pytest.approx(2.0**-8) and dec["n_streams"] == 8
    assert dec["mde"] > 0
    assert dec["mean_rank_heavy"] == pytest.approx(3) and dec["mean_rank_light"] == pytest.approx(7)
    assert dec["support"] == pytest.approx(0.3) and dec["overlap"] == pytest.approx(1.0)
    assert dec["calib_support"] == 0.3 and dec["max_target"] == 0.045
    assert dec["dropped_heavy"] == pytest.approx(0.0)
    # the study design keeps its own rule and statistic (ΔNLL per unit mass)
    study = by_design["study"]["decision"]
    assert study["outcome"] == "heavy worse" and study["effect_label"].startswith("ΔNLL/mass")
    table = pd.read_parquet(tmp_path / "an" / "expb.parquet")
    need = {"model", "design", "target_mass", "valid", "outcome", "p_value", "n_streams",
            "realized_heavy", "realized_light"}  # fmt: skip
    assert need <= set(table.columns)
    assert sorted(zip(table["design"], table["target_mass"], strict=True)) == [
        ("matched", 0.2), ("matched", 0.4), ("study", 0.2)
    ]  # fmt: skip
    streams = pd.read_parquet(tmp_path / "an" / "expb_streams.parquet")
    assert len(streams) == 3 * 8 and streams["usable"].all()


def test_experiment_b_needs_rule_and_capture(tmp_path):
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss"])
    rules = params.pop("expb")
    doc = run_analysis(inputs, params, tmp_path / "a1")
    assert doc["parts"]["expb"]["status"] == "missing"
    assert "decision rule" in doc["parts"]["expb"]["reason"]
    doc2 = run_analysis(
        {**inputs, "capture_tokens": []}, {**params, "expb": rules}, tmp_path / "a2"
    )
    assert "capture" in doc2["parts"]["expb"]["reason"]
    moved = {**rules, "designs": {**rules["designs"], "matched": {"primary": 0.5}}}
    doc3 = run_analysis(inputs, {**params, "expb": moved}, tmp_path / "a3")
    dec = next(e for e in doc3["expb"] if e["design"] == "matched")["decision"]
    assert (
        dec["outcome"] == "invalid" and "no heavy and light runs at m* = 0.5" in dec["outcome_text"]
    )
