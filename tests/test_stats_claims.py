"""moesub.stats.multiplicity and moesub.stats.claims: Holm and Benjamini-Hochberg against
hand-computed values, the direction words, each verdict of a claim, and the claims of whole
synthetic studies (tests/fixtures_artefacts.py) in each direction."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import make_study

from moesub.metrics import speedup_text
from moesub.stats import run_analysis
from moesub.stats.claims import (
    CONTRADICTS,
    NOT_MEASURED,
    REPRODUCES,
    UNDECIDED,
    Part,
    combine,
    expb_parts,
    verdict_of_figure,
    verdict_of_test,
)
from moesub.stats.multiplicity import (
    AGAINST,
    FAMILY,
    NO_EFFECT,
    NOT_TESTED,
    SUPPORTS,
    StatTest,
    benjamini_hochberg,
    direction,
    family_table,
    holm,
)


# ------------------------------------------------------------------------------ adjustments
def test_holm_by_hand():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06
    # (monotone: never below an earlier step)
    p = [0.01, 0.04, 0.03, 0.005]
    np.testing.assert_allclose(holm(p), [0.03, 0.06, 0.06, 0.02], rtol=0, atol=1e-15)
    np.testing.assert_allclose(holm([0.5, 0.6]), [1.0, 1.0])  # capped at 1
    np.testing.assert_allclose(holm([0.02]), [0.02])


def test_benjamini_hochberg_by_hand():
    # sorted: 0.005 x 4/1 = 0.02, 0.01 x 4/2 = 0.02, 0.03 x 4/3 = 0.04, 0.04 x 4/4 = 0.04
    p = [0.01, 0.04, 0.03, 0.005]
    np.testing.assert_allclose(benjamini_hochberg(p), [0.02, 0.04, 0.04, 0.02], atol=1e-15)
    # 0.5 x 2 = 1.0 is lowered to the next step's 0.6 x 2 / 2 = 0.6 (monotone from the top)
    np.testing.assert_allclose(benjamini_hochberg([0.5, 0.6]), [0.6, 0.6])


def test_direction_words():
    assert direction(0.01, 0.3, 1, 0.05) == SUPPORTS
    assert direction(0.01, -0.3, 1, 0.05) == AGAINST
    assert direction(0.01, -0.3, -1, 0.05) == SUPPORTS
    assert direction(0.2, 0.3, 1, 0.05) == NO_EFFECT
    assert direction(0.05, 0.3, 1, 0.05) == NO_EFFECT  # p = alpha does not reject
    assert direction(None, 0.3, 1, 0.05) == NOT_TESTED
    # a hypothesis of no effect (expected 0): a rejection either way is evidence against it
    assert direction(0.01, 0.3, 0, 0.05) == AGAINST
    assert direction(0.01, -0.3, 0, 0.05) == AGAINST
    assert direction(0.2, 0.3, 0, 0.05) == NO_EFFECT


def make_test(kind: str, p: float | None, estimate: float = 1.0, **kw) -> StatTest:
    return StatTest(kind=kind, name=f"{kind} {p}", hypothesis="h", expected=1, estimand="e",
                estimate=estimate, p_value=p, **kw)  # fmt: skip


def test_family_table_adjusts_each_family_apart():
    tests = [
        make_test("dppl_contrast", 0.01),
        make_test("mass_hypothesis", 0.04, estimate=-0.5),
        make_test("expb_primary", None, reason="invalid (why)"),
        make_test("per_input", 0.03),
        make_test("per_input", 0.005),
    ]
    df = family_table(tests, alpha=0.05).set_index("name")
    pre = df[df["family"] == "pre-registered"]
    # Holm over the 2 tests with a p-value: 0.01 x 2, then max(0.04 x 1, 0.02)
    assert (pre["family_size"] == 2).all() and (pre["adjustment"] == "Holm").all()
    assert df.loc["dppl_contrast 0.01", "p_adjusted"] == pytest.approx(0.02)
    assert df.loc["mass_hypothesis 0.04", "p_adjusted"] == pytest.approx(0.04)
    assert df.loc["mass_hypothesis 0.04", "direction"] == AGAINST  # the other sign
    assert df.loc["expb_primary None", "direction"] == NOT_TESTED
    assert math.isnan(df.loc["expb_primary None", "p_adjusted"])
    # BH over the exploratory two: 0.005 x 2 = 0.01, 0.03 x 2 / 2 = 0.03
    assert df.loc["per_input 0.005", "p_adjusted"] == pytest.approx(0.01)
    assert df.loc["per_input 0.03", "p_adjusted"] == pytest.approx(0.03)
    assert list(df["family"]) == ["pre-registered"] * 3 + ["exploratory"] * 2


def test_every_kind_has_a_family_and_unknown_kinds_are_refused():
    assert set(FAMILY.values()) == {"pre-registered", "exploratory"}
    with pytest.raises(ValueError, match="has no family"):
        make_test("no_such_kind", 0.1)


# ------------------------------------------------------------------------------ verdicts
def row(direction_: str, estimate: float, lo: float, hi: float, **kw) -> dict:
    base = {"name": "t", "fraction": 0.25, "p_value": 0.001, "p_adjusted": 0.004,
            "adjustment": "Holm", "direction": direction_, "estimate": estimate,
            "ci_lo": lo, "ci_hi": hi, "mde": 0.1, "measured": True}  # fmt: skip
    return {**base, **kw}


def test_test_verdict_each_direction():
    assert verdict_of_test(row(SUPPORTS, 1.0, 0.5, 1.5), "95% CI").verdict == REPRODUCES
    against = verdict_of_test(row(AGAINST, -1.0, -1.5, -0.5), "95% CI")
    assert against.verdict == CONTRADICTS and "evidence against the hypothesis" in against.text
    none = verdict_of_test(row(NO_EFFECT, 0.1, -0.2, 0.4, p_adjusted=0.3), "95% CI")
    assert none.verdict == UNDECIDED and "(MDE 0.1, normal approximation)" in none.text
    # a claimed range: an interval wholly outside it contradicts, even with the right sign
    small = verdict_of_test(row(SUPPORTS, -0.001, -0.0019, -0.0001), "95% CI", (-0.015, -0.003))
    assert small.verdict == CONTRADICTS and "outside the study's" in small.text
    inside = verdict_of_test(row(SUPPORTS, -0.01, -0.02, -0.005), "95% CI", (-0.015, -0.003))
    assert inside.verdict == REPRODUCES
    # no p-value: cannot decide, or not measured when the run lacks the data
    invalid = verdict_of_test(
        row(NOT_TESTED, None, None, None, p_value=None, reason="invalid (x)"), ""
    )
    assert invalid == Part(UNDECIDED, "t (f 0.25): invalid (x)")
    lacking = row(NOT_TESTED, None, None, None, p_value=None, reason="no twin", measured=False)
    assert verdict_of_test(lacking, "").verdict == NOT_MEASURED


def test_range_verdicts():
    claimed = (2.5, 3.0)
    assert verdict_of_figure("x", 2.7, 2.4, 3.1, claimed, "w").verdict == REPRODUCES
    assert verdict_of_figure("x", 4.5, 4.3, 4.7, claimed, "w").verdict == CONTRADICTS
    assert verdict_of_figure("x", 2.3, 2.1, 2.6, claimed, "w").verdict == UNDECIDED  # straddles
    assert verdict_of_figure("x", 2.3, None, None, claimed, "w").verdict == CONTRADICTS  # a point
    assert verdict_of_figure("x", 2.8, None, None, claimed, "w").verdict == REPRODUCES
    assert verdict_of_figure("x", None, None, None, claimed, "w").verdict == NOT_MEASURED


def test_combine():
    r, c, u, n = (Part(v, "") for v in (REPRODUCES, CONTRADICTS, UNDECIDED, NOT_MEASURED))
    assert combine([r, r, n]) == REPRODUCES
    assert combine([c, u]) == CONTRADICTS
    assert combine([r, c]) == UNDECIDED  # mixed
    assert combine([r, u]) == UNDECIDED
    assert combine([n, n]) == NOT_MEASURED and combine([]) == NOT_MEASURED


def test_experiment_b_parts_the_factorial_rank_decides_who_judges():
    """The rule of `expb_parts`: a rank effect at a fixed weight (either sign) hands the claim
    to the factorial's weight test, the designs quoted beside it; otherwise the designs judge
    it and the factorial is quoted."""

    def tests(design: str, weight: str, rank: str, rank_estimate: float = 0.002):
        rows = [
            row(design, 1.0, 0.5, 1.5, name="matched design, m* 0.004", kind="expb_primary"),
            row(weight, 0.003, 0.001, 0.005, name="expb.factorial.weight",
                kind="expb_factorial_main"),
            row(rank, rank_estimate, -0.004, 0.006, name="expb.factorial.rank",
                kind="expb_factorial_main"),
        ]  # fmt: skip
        return pd.DataFrame(rows).assign(fraction=None)  # Experiment B has no cache fraction

    # no detectable rank effect: the designs judge; the factorial is quoted beside them
    parts, beside = expb_parts(tests(SUPPORTS, NO_EFFECT, NO_EFFECT), "95% CI")
    assert [q.verdict for q in parts] == [REPRODUCES]
    assert parts[0].text.startswith("matched design, m* 0.004: ")
    assert [b.split(": ")[0] for b in beside] == [
        "factorial design, the weight at a fixed rank",
        "factorial design, the rank at a fixed weight",
    ]
    # nor does the factorial's weight test overrule them then
    parts, _ = expb_parts(tests(AGAINST, SUPPORTS, NO_EFFECT), "95% CI")
    assert [q.verdict for q in parts] == [CONTRADICTS]
    # the rank matters (either sign): the factorial's weight test is the one part
    for sign in (1.0, -1.0):
        parts, beside = expb_parts(tests(SUPPORTS, NO_EFFECT, AGAINST, sign * 0.004), "95% CI")
        assert [q.verdict for q in parts] == [UNDECIDED]
        assert parts[0].text.startswith("factorial design, the weight at a fixed rank: ")
        assert "may be the rank's" in beside[0]
        assert beside[1].startswith("confounded by the rank: matched design, m* 0.004: ")
    parts, _ = expb_parts(tests(AGAINST, SUPPORTS, AGAINST), "95% CI")
    assert combine(parts) == REPRODUCES
    parts, _ = expb_parts(tests(SUPPORTS, AGAINST, AGAINST), "95% CI")
    assert combine(parts) == CONTRADICTS
    # no factorial: the designs alone, nothing beside them
    only = tests(SUPPORTS, NO_EFFECT, AGAINST).iloc[:1]
    assert expb_parts(only, "95% CI")[1] == [] and combine(expb_parts(only, "")[0]) == REPRODUCES


def test_speedup_text_never_says_faster_below_one():
    assert speedup_text(2.5, "base") == "2.50× faster than base"
    assert speedup_text(0.96, "base") == "1.04× slower than base"
    assert speedup_text(1.001, "base") == "as fast as base"


# ------------------------------------------------------------------------------ whole studies
def claims_of(tmp_path, **study) -> dict[str, dict]:
    design_only = study.pop("matched_only", False)
    inputs, params = make_study(tmp_path / "r", **study)
    if design_only:  # the matched design alone decides Experiment B
        params["expb"]["designs"].pop("study")
    doc = run_analysis(inputs, params, tmp_path / "an")
    return {c["claim"]: c for c in doc["claims"]}


@pytest.mark.parametrize(
    ("case", "verdict"),
    [("heavy_worse", REPRODUCES), ("no_evidence", CONTRADICTS), ("invalid_gap", UNDECIDED)],
)
def test_experiment_b_claim_each_direction(tmp_path, case, verdict):
    """Light hurting more (the fixture's no_evidence case: heavy has half light's ΔNLL per
    unit mass on every stream) is evidence against the hypothesis, not "no evidence"."""
    names = ["fetch_every_miss", "rule_015"]
    claims = claims_of(tmp_path, names=names, expb_case=case, matched_only=True)
    assert claims["expb"]["verdict"] == verdict, claims["expb"]
    if case == "no_evidence":
        assert "evidence against the hypothesis" in claims["expb"]["details"]
    # the fixture's factorial: no rank effect, so the designs judge, the factorial beside them
    assert claims["expb"]["context"].startswith("factorial design, the weight at a fixed rank: ")
    assert "factorial design, the rank at a fixed weight: " in claims["expb"]["context"]


def test_experiment_b_claim_when_the_factorial_finds_a_rank_effect(tmp_path):
    """A rank effect at a fixed weight (the fixture's factorial with the high rank costing
    0.002 more on every stream, give or take): the matched design's "heavy worse" is quoted as
    confounded, and the factorial's weight test (heavy costs more) reproduces the claim; the
    designs' "light worse" no longer contradicts it."""
    names = ["fetch_every_miss", "rule_015"]
    for case in ("heavy_worse", "no_evidence"):
        claims = claims_of(tmp_path / case, names=names, expb_case=case, matched_only=True,
                           factorial_rank=0.002)  # fmt: skip
        expb = claims["expb"]
        assert expb["verdict"] == REPRODUCES, expb
        assert expb["details"].startswith("factorial design, the weight at a fixed rank: ")
        assert "may be the rank's" in expb["context"]
        assert "confounded by the rank: matched design" in expb["context"]


def test_admission_claim_inside_and_outside_the_studys_range(tmp_path):
    # gain 0.022 nat decaying over a 16-token document: about a 1% cut, inside 0.3-1.5%
    names = ["fetch_every_miss", "quality", "rule_015_lfu"]
    inside = claims_of(tmp_path / "in", names=names, admission_gain=0.022)["admission"]
    assert inside["verdict"] == REPRODUCES, inside
    larger = claims_of(tmp_path / "out", names=names, admission_gain=0.08)["admission"]
    assert larger["verdict"] == CONTRADICTS and "outside the study's" in larger["details"]
    twinless = claims_of(tmp_path / "no", names=["fetch_every_miss", "quality"])["admission"]
    assert twinless["verdict"] == NOT_MEASURED


def test_fixture_claims(tmp_path):
    """The default fixture: the 0.15 rule and the mass hypothesis reproduce (r = 1 by
    construction); speed vs host_compute is 4.5x, outside the study's 2.8-3.0x; a claim
    whose policies did not run is not measured."""
    claims = claims_of(tmp_path)
    assert claims["rule_015"]["verdict"] == REPRODUCES
    assert claims["mass"]["verdict"] == REPRODUCES
    assert claims["host"]["verdict"] == CONTRADICTS
    assert "4.50× faster than host_compute" in claims["host"]["details"]
    bare = claims_of(tmp_path / "bare", names=["fetch_every_miss", "rule_015"])
    assert bare["rule_015"]["verdict"] == NOT_MEASURED  # substitute_all did not run
    assert bare["speed"]["verdict"] == NOT_MEASURED
    tests = pd.read_parquet(tmp_path / "bare" / "an" / "tests.parquet")
    assert "dppl_contrast" not in set(tests["kind"])


def test_why_out_reads_config_policies_with_layout_keys():
    """A config policy with a pin spec ("50%", "C-k") or an allocation is a point of r or not by
    its Policy fields alone (the layout keys are not Policy fields)."""
    from moesub.stats.mass import why_out

    pinned_rule = {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "pin": "50%"}
    assert why_out(pinned_rule, 0.01) is None
    assert why_out({**pinned_rule, "allocation": "planned"}, 0.0).startswith("substituted")
    assert why_out({"rule": "fetch_all", "eviction": "lru", "pin": "C-k"}, 0.0).startswith(
        "lossless"
    )


def test_provenance_carries_each_simulated_layout():
    """A planned or pinned policy's per-layer capacities and pins reach analysis.json (the
    recommendation's slots per layer and the plan read them there)."""
    from moesub.stats.load import FileInfo, provenance_entry

    layout = {"size": {"label": "f0.25", "capacity": 8, "fraction": 0.25},
              "allocation": "planned", "capacities": [9, 7], "pins": [2, 0]}  # fmt: skip
    info = FileInfo("s.parquet", "simulate", 4, {"name": "p", "fraction": 0.25, "layout": layout})
    assert provenance_entry(info)["metadata"]["layout"] == layout
