"""Experiment B's factorial design: the cells (`cell_ranks`), the stratified paired selection
(`select_stratum`), the plan, feasibility, the stage, and the statistics against hand-computed
values (`moesub.stats.expb_factorial`)."""

from __future__ import annotations

import dataclasses
import math
import shutil

import numpy as np
import pandas as pd
import polars as pl
import pytest
from fixtures_artefacts import FACTORIAL_CELLS, tokens_table, write_capture, write_expb_factorial
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from moesub.artefacts import Trace, load_trace
from moesub.expb import (
    CELLS,
    CONTRASTS,
    FactorialSpec,
    cell_ranks,
    check_feasible,
    factorial_plan,
    gate_weights,
    run_factorial,
    run_factorial_feasibility,
    select_stratum,
)
from moesub.io import read_metadata
from moesub.stats import FactorialRule, run_analysis
from moesub.stats.expb_factorial import TESTS, contrast_matrix
from moesub.stats.multiplicity import FAMILY, benjamini_hochberg, holm

SPEC = FactorialSpec(low_ranks=(2, 3), high_ranks=(5, 6), light=(0.05, 0.1), heavy=(0.1, 0.2))


# --------------------------------------------------------------------------- the cells
def test_cell_ranks_by_hand():
    w = np.array(
        [
            [0.40, 0.15, 0.08, 0.07, 0.12, 0.06, 0.12],  # (cell_ranks needs no rank order)
            [0.40, 0.12, 0.11, 0.10, 0.10, 0.09, 0.08],
            [0.70, 0.20, 0.04, 0.02, 0.02, 0.01, 0.01],
        ]
    )
    ranks = cell_ranks(w, SPEC)  # 0-based rank index per cell, CELLS order
    assert CELLS == ("low_light", "low_heavy", "high_light", "high_heavy")
    # row 0: low bucket ranks 2-3 = (0.15, 0.08); high ranks 5-6 = (0.12, 0.06)
    assert ranks[0].tolist() == [2, 1, 5, 4]
    # row 1: (0.12, 0.11) both heavy -> the best rank; (0.10, 0.09): 0.10 is heavy ([lo, hi))
    assert ranks[1].tolist() == [-1, 1, 5, 4]
    # row 2: rank 2 = 0.20 is past the heavy band's hi; ranks 5-6 below the light band
    assert ranks[2].tolist() == [-1, -1, -1, -1]
    with pytest.raises(ValueError, match=r"high_ranks=\[5, 6\] reaches past the router's top-k"):
        cell_ranks(w[:, :5], SPEC)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"low_ranks": [1, 2]}, r"low_ranks=\[1, 2\] .* less than the minimum of 2"),
        ({"low_ranks": [3, 6], "high_ranks": [6, 8]}, "rank buckets"),
        ({"light": [0.05, 0.12], "heavy": [0.1, 0.2]}, "weight bands"),
        ({"light": [0.1, 0.05]}, "weight bands"),
        ({"share": 1.5}, "share"),
        ({"bands": 2}, r"unknown expb.designs.factorial option\(s\) \['bands'\]"),
        ({"low_ranks": [3]}, "low_ranks"),
    ],
)
def test_spec_refuses_bad_cells(spec, match):
    with pytest.raises(ValueError, match=match):
        FactorialSpec.from_dict(spec)


def test_spec_checks_direct_construction():
    with pytest.raises(ValueError, match="rank buckets"):
        FactorialSpec(low_ranks=(1, 2))
    with pytest.raises(ValueError, match="weight bands"):
        FactorialSpec(light=(0.1, 0.12), heavy=(0.11, 0.2))


def test_spec_defaults_are_the_schemas():
    spec = FactorialSpec.from_dict({"enabled": True, "max_weight_gap": 0.2})
    assert spec.as_dict() == {"low_ranks": [3, 3], "high_ranks": [6, 6], "light": [0.07, 0.09],
                              "heavy": [0.095, 0.107], "share": 0.1}  # fmt: skip
    assert spec.cell("high_light") == ((6, 6), (0.07, 0.09))


# --------------------------------------------------------------------------- one stratum
@st.composite
def strata(draw):
    """A stratum's support (T, 4) with the design's structure: low_light and high_heavy never
    together; a hash u; a count m within every cell's support."""
    t = draw(st.integers(4, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    p = rng.uniform(0.1, 0.9, size=4)
    support = rng.random((t, 4)) < p
    support[support[:, 0], 3] = False  # low_light excludes high_heavy
    cap = int(support.sum(axis=0).min())
    m = draw(st.integers(0, cap))
    return support, rng.random(t), m


@settings(max_examples=300, deadline=None)
@given(strata())
def test_select_stratum_equal_counts_within_support(case):
    support, u, m = case
    chosen = select_stratum(support, u, m)
    assert chosen.shape == support.shape and chosen.dtype == bool
    assert (chosen.sum(axis=0) == m).all()  # the same count in every cell
    assert not (chosen & ~support).any()  # only where the cell's expert exists
    # pairing: a contrast's cells share at least what the first round guarantees, when the
    # token-layers supporting both are plentiful (every contrast gets its half)
    for _, a, b in CONTRASTS:
        ia, ib = CELLS.index(a), CELLS.index(b)
        both = (support[:, ia] & support[:, ib]).sum()
        if both >= 2 * m:
            assert (chosen[:, ia] & chosen[:, ib]).sum() >= m // 2


def test_select_stratum_by_hand():
    # 8 token-layers; hash order = index order. Columns: low_light, low_heavy, high_light,
    # high_heavy. Rows 0-3 support the light cells, rows 4-7 the heavy ones (single-rank
    # buckets: no token-layer supports both cells of a weight contrast).
    s = np.zeros((8, 4), dtype=bool)
    s[:4, [0, 2]] = True
    s[4:, [1, 3]] = True
    chosen = select_stratum(s, np.arange(8) / 8, 3)
    # round 1 gives each rank contrast 1 (= 3 // 2) shared token-layer, round 2 the rest: the
    # rank contrasts share all 3, the weight contrasts none (they cannot)
    assert chosen[:, 0].tolist() == chosen[:, 2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert chosen[:, 1].tolist() == chosen[:, 3].tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    # every token-layer supports every cell but the diagonal pair: each contrast gets half
    s = np.ones((8, 4), dtype=bool)
    s[:4, 3] = False  # rows 0-3: no high_heavy
    s[4:, 0] = False  # rows 4-7: no low_light
    chosen = select_stratum(s, np.arange(8) / 8, 2)
    shared = {n: int((chosen[:, CELLS.index(a)] & chosen[:, CELLS.index(b)]).sum())
              for n, a, b in CONTRASTS}  # fmt: skip
    assert shared == {"weight_at_low": 1, "weight_at_high": 1, "rank_at_light": 1,
                      "rank_at_heavy": 1}  # fmt: skip
    assert (chosen.sum(axis=0) == 2).all()
    with pytest.raises(ValueError, match="exceeds a cell's support"):
        select_stratum(s, np.arange(8) / 8, 5)


# --------------------------------------------------------------------------- the plan
E, K, L = 24, 8, 3


def synthetic_trace(n_streams=3, T=80, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    logits = [(rng.normal(size=(T, L, E)) * 1.5).astype(np.float32) for _ in range(n_streams)]
    meta = {"num_experts": E, "top_k": K, "num_layers": L, "norm_topk_prob": True}
    return Trace(list(range(n_streams)), logits, meta)


def test_plan_equal_counts_same_token_layers_and_the_cells_experts():
    trace = synthetic_trace()
    spec = FactorialSpec(low_ranks=(2, 3), high_ranks=(5, 6), light=(0.06, 0.1),
                         heavy=(0.1, 0.16), share=0.1)  # fmt: skip
    plan = factorial_plan(trace, spec, seed=0)
    T = 80
    at = {c: [(ids >= 0) for ids in plan.ids[c]] for c in CELLS}  # per stream (T, L, k)
    expected = 0
    for i, z in enumerate(trace.logits):
        w, sel = gate_weights(z, K)  # (T, L, k)
        ranks = cell_ranks(w.reshape(-1, K), spec).reshape(T, L, 4)
        for layer in range(L):
            m = min(round(0.1 * T), int((ranks[:, layer] >= 0).sum(axis=0).min()))
            expected += m
            for c in CELLS:  # the same count per (stream, layer) in every cell
                assert at[c][i][:, layer].any(axis=1).sum() == m
        for j, c in enumerate(CELLS):
            a = at[c][i]
            assert (a.sum(axis=2) <= 1).all() and not a[..., 0].any()  # one tail expert
            t, layer, r = np.nonzero(a)
            assert (r == ranks[t, layer, j]).all()  # the cell's expert: its rank, its band
            np.testing.assert_array_equal(plan.ids[c][i][t, layer, r], sel[t, layer, r])
    assert plan.count == expected > 0 and plan.stream_counts == [
        int(a.any(axis=2).sum()) for a in at["low_light"]
    ]
    # the shared shares are what the ids say; the diagonal pair never meets (disjoint bands)
    for name, a, b in CONTRASTS:
        both = sum(
            int((x.any(axis=2) & y.any(axis=2)).sum()) for x, y in zip(at[a], at[b], strict=True)
        )
        assert plan.shared[name] == pytest.approx(both / plan.count)
    assert plan.all_cells == 0.0
    assert plan.max_share >= plan.realized_share
    weights = np.concatenate([gate_weights(z, K)[0].reshape(-1, K) for z in trace.logits])
    for c in CELLS:
        assert spec.cell(c)[1][0] <= plan.mean_weight[c] < spec.cell(c)[1][1]
        assert plan.eligible[c] == int((cell_ranks(weights, spec)[:, CELLS.index(c)] >= 0).sum())
    # seeded: the same seed gives the same plan, another seed another subsample
    again = factorial_plan(trace, spec, seed=0)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(again.ids["high_light"], plan.ids["high_light"], strict=True)
    )
    other = factorial_plan(trace, spec, seed=1)
    assert not all(
        np.array_equal(x, y)
        for x, y in zip(other.ids["high_light"], plan.ids["high_light"], strict=True)
    )
    whole = factorial_plan(trace, dataclasses.replace(spec, share=1.0), seed=0)
    assert whole.realized_share == pytest.approx(whole.max_share)


def test_check_feasible_names_the_empty_cell():
    trace = synthetic_trace()
    # rank 6 never reaches 0.3: high_heavy has no support
    spec = FactorialSpec(low_ranks=(2, 2), high_ranks=(6, 6), light=(0.05, 0.1), heavy=(0.3, 0.5))
    plan = factorial_plan(trace, spec, seed=0)
    assert plan.eligible["high_heavy"] == 0 and plan.count == 0
    with pytest.raises(ValueError, match=r"infeasible: no token-layer of the x \(720\) supports "
                       r".*high_heavy \(ranks 6-6, weight in \[0.3, 0.5\)\)"):  # fmt: skip
        check_feasible(plan, spec, "the x")


# --------------------------------------------------------------------------- the stage
STAGE_SPEC = {"low_ranks": [2, 3], "high_ranks": [5, 6], "light": [0.06, 0.1],
              "heavy": [0.1, 0.16], "share": 0.2}  # fmt: skip


def test_run_factorial_feasibility(expb_stage):
    out = expb_stage / "bad.parquet"
    bad = {**STAGE_SPEC, "heavy": [0.4, 0.6]}
    with pytest.raises(ValueError, match=r"expb.designs.factorial: infeasible: .*high_heavy"):
        run_factorial_feasibility(expb_stage / "calib_router.parquet", out, bad, 0)
    assert not out.exists()
    out = run_factorial_feasibility(
        expb_stage / "calib_router.parquet", expb_stage / "feas.parquet", STAGE_SPEC, 0
    )
    table, meta = pl.read_parquet(out), read_metadata(out)
    plan = factorial_plan(load_trace(expb_stage / "calib_router.parquet"),
                          FactorialSpec.from_dict(STAGE_SPEC), 0)  # fmt: skip
    assert table["cell"].to_list() == list(CELLS)
    assert table["eligible"].to_list() == [plan.eligible[c] for c in CELLS]
    assert (table["count"] == plan.count).all() and plan.count > 0
    assert meta["spec"] == FactorialSpec.from_dict(STAGE_SPEC).as_dict() and meta["seed"] == 0
    assert meta["max_share"] == plan.max_share and meta["all_cells"] == 0.0


def test_run_factorial_substitutes_the_plan(expb_stage):
    feas = run_factorial_feasibility(
        expb_stage / "calib_router.parquet", expb_stage / "feas.parquet", STAGE_SPEC, 0
    )
    inputs = ("model", "eval_tokens.parquet", "ranking.parquet", "eval_router.parquet")
    args = (*(expb_stage / name for name in inputs), feas)
    params = {"fraction": 0.75, "progress": False, "seed": 0}
    plan = factorial_plan(load_trace(expb_stage / "eval_router.parquet"),
                          FactorialSpec.from_dict(STAGE_SPEC), 0)  # fmt: skip
    subs = {}
    for cell in ("low_light", "high_light"):
        path = run_factorial(*args, cell, expb_stage / f"{cell}.parquet", STAGE_SPEC, params)
        df, meta = pl.read_parquet(path), read_metadata(path)
        assert meta["design"] == "factorial" and meta["condition"] == cell
        assert meta["plan_count"] == plan.count and meta["plan_shared"] == plan.shared
        planned = np.concatenate([(i >= 0).any(axis=2) for i in plan.ids[cell]])  # (N, L)
        lm = np.stack(df["layer_mass"].to_list())
        assert ((lm > 0) <= planned).all()  # substituted only where planned
        assert df["n_planned"].sum() == planned.sum() == plan.count
        assert df["n_sub"].sum() >= 0.9 * plan.count  # few planned experts leave the top-k
        subs[cell] = lm > 0
    both = (subs["low_light"] & subs["high_light"]).sum()
    assert both >= 0.8 * plan.shared["rank_at_light"] * plan.count  # the same token-layers
    with pytest.raises(ValueError, match="feasibility_path: made for"):  # a stale feasibility
        run_factorial(*args, "low_light", expb_stage / "x.parquet", {**STAGE_SPEC, "share": 0.1},
                      params)  # fmt: skip
    with pytest.raises(ValueError, match="cell must be one of"):
        run_factorial(*args, "low", expb_stage / "x.parquet", STAGE_SPEC, params)
    assert not (expb_stage / "x.parquet").exists()


# --------------------------------------------------------------------------- the statistics
def test_contrast_matrix_and_the_tests_families():
    m = contrast_matrix()
    d = np.array([[1.0, 3.0, 2.0, 7.0]])  # low_light, low_heavy, high_light, high_heavy
    assert (d @ m).tolist() == [[3.5, 2.5, 2.0, 5.0, 1.0, 4.0]]  # TESTS order
    assert [t[0] for t in TESTS] == ["weight", "rank", "weight_at_low", "weight_at_high",
                                     "rank_at_light", "rank_at_heavy"]  # fmt: skip
    # the pooled contrasts pre-registered, the per-bucket ones exploratory; weight predicted
    # > 0, rank predicted 0
    assert [FAMILY[kind] for _, kind, _, _ in TESTS] == ["pre-registered"] * 2 + ["exploratory"] * 4
    assert [expected for *_, expected, _ in TESTS] == [1, 0, 1, 1, 0, 0]


def factorial_inputs(root, d_cells, n_streams=4):
    tok = tokens_table(n_streams, 32, 16, seed=0)
    *runs, feas = write_expb_factorial(root / "m", tok, d_cells)
    inputs = {"capture_tokens": [str(write_capture(root / "m", tok))],
              "expb_factorial": [str(p) for p in runs],
              "expb_factorial_feasibility": [str(feas)]}  # fmt: skip
    return inputs


def params(gap=0.1):
    return {"expb": {"designs": {"factorial": {"max_weight_gap": gap}}}, "n_boot": 400}


def test_estimands_against_a_hand_computed_example(tmp_path):
    # ΔNLL per substituted token-layer, streams 0..3 (the fixture puts each stream's sum on it)
    d = {"low_light": np.array([1.0, 2.0, 3.0, 4.0]) * 1e-3,
         "low_heavy": np.array([2.0, 4.0, 5.0, 5.0]) * 1e-3,
         "high_light": np.array([1.0, 1.0, 2.0, 2.0]) * 1e-3,
         "high_heavy": np.array([3.0, 2.0, 4.0, 3.0]) * 1e-3}  # fmt: skip
    doc = run_analysis(factorial_inputs(tmp_path, d), params(), tmp_path / "an")
    tests = pd.read_parquet(tmp_path / "an" / "expb_factorial.parquet").set_index("test")
    family = pd.read_parquet(tmp_path / "an" / "tests.parquet").set_index("name")
    t_crit = sps.t.ppf(0.5 + doc["params"]["ci_level"] / 2, 3)
    # weight_at_low d = (1, 2, 2, 1)e-3: mean 1.5e-3, sd = sqrt(1/3)e-3
    # weight_at_high d = (2, 1, 2, 1)e-3; weight = their mean = (1.5, 1.5, 2, 1)e-3
    # rank_at_light d = (0, -1, -1, -2)e-3; rank_at_heavy = (1, -2, -1, -2)e-3
    hand = {"weight_at_low": [1, 2, 2, 1], "weight_at_high": [2, 1, 2, 1],
            "weight": [1.5, 1.5, 2, 1], "rank_at_light": [0, -1, -1, -2],
            "rank_at_heavy": [1, -2, -1, -2], "rank": [0.5, -1.5, -1, -2]}  # fmt: skip
    z = sps.norm.ppf(0.975) + sps.norm.ppf(0.8)
    for test, values in hand.items():
        x = np.array(values) * 1e-3
        mean, sd = x.mean(), x.std(ddof=1)
        t_stat = mean / (sd / 2.0)  # n = 4
        row = tests.loc[test]
        assert row["estimate"] == pytest.approx(mean, rel=1e-9)  # ΔNLL sums in float
        assert row["sd"] == pytest.approx(sd, rel=1e-9)
        assert row["p_value"] == pytest.approx(2 * sps.t.sf(abs(t_stat), 3), rel=1e-6)
        assert row["mde"] == pytest.approx(z * sd / 2.0, rel=1e-9)
        assert row["estimate_ci_lo"] <= mean <= row["estimate_ci_hi"]
        assert row["n_streams"] == 4 and row["unit"] == "ΔNLL per substituted token-layer"
        # tests.parquet: the t interval the t-test inverts, the raw p beside the adjusted one
        f = family.loc[f"expb.factorial.{test}"]
        assert f["estimate"] == row["estimate"] and f["p_value"] == row["p_value"]
        assert f["ci_lo"] == pytest.approx(mean - t_crit * sd / 2.0, rel=1e-9)
        assert f["ci_hi"] == pytest.approx(mean + t_crit * sd / 2.0, rel=1e-9)
        assert f["ci_lo"] == row["estimate_t_ci_lo"] and f["ci_hi"] == row["estimate_t_ci_hi"]
        assert f["family"] == row["family"] and f["n_units"] == 4
    assert tests.loc["weight_at_low", "sd"] == pytest.approx(math.sqrt(1 / 3) * 1e-3)
    assert tests.loc["weight", "family"] == "pre-registered"
    assert tests.loc["rank_at_light", "name"] == "expb.factorial.rank_at_light"
    # the only tests of this run: Holm over the two pooled, Benjamini-Hochberg over the four
    pre = family[family["family"] == "pre-registered"]
    np.testing.assert_allclose(pre["p_adjusted"], holm(pre["p_value"]))
    assert (pre["adjustment"] == "Holm").all() and (pre["family_size"] == 2).all()
    bucket = family[family["family"] == "exploratory"]
    np.testing.assert_allclose(bucket["p_adjusted"], benjamini_hochberg(bucket["p_value"]))
    # the weight (p 0.0052 raw, 0.010 Holm) supports; the rank (p 0.16, 0.16) finds nothing
    assert family.loc["expb.factorial.weight", "direction"] == "supports"
    assert family.loc["expb.factorial.rank", "direction"] == "no detectable effect"
    # the realized weights of the fixture: light 0.082 / 0.079, heavy 0.102 / 0.098
    w = FACTORIAL_CELLS
    gap = abs(w["high_light"][0] - w["low_light"][0]) / w["high_light"][0]
    assert tests.loc["rank_at_light", "weight_gap"] == pytest.approx(gap)
    assert tests.loc["rank_at_light", "rank_other"] == 6
    assert tests.loc["rank", "shared"] == 1.0  # the fixture's cells share their token-layers
    cells = pd.read_parquet(tmp_path / "an" / "expb_factorial_cells.parquet").set_index("cell")
    assert cells.loc["low_heavy", "dnll_per_sub"] == pytest.approx(4e-3)
    assert cells.loc["low_heavy", "planned"] == 16 and cells.loc["low_heavy", "dropped"] == 0


def test_weight_gap_invalidates_the_rank_contrasts(tmp_path):
    d = {c: np.linspace(1, 2, 4) * 1e-3 for c in CELLS}
    doc = run_analysis(factorial_inputs(tmp_path, d), params(gap=0.03), tmp_path / "an")
    (res,) = doc["expb_factorial"]
    by = {t["test"]: t for t in res["tests"]}
    # light: 0.082 vs 0.079 (3.8% > 3%); heavy: 0.102 vs 0.098 (4.1%)
    assert not by["rank_at_light"]["valid"] and not by["rank"]["valid"]
    assert by["rank_at_light"]["invalid_reason"].startswith("realized mean weights 0.082 vs")
    assert by["rank"]["invalid_reason"] == "rank_at_heavy and rank_at_light invalid"
    assert by["weight"]["valid"]
    # in tests.parquet: no p-value, the reason, not counted in the family
    family = pd.read_parquet(tmp_path / "an" / "tests.parquet").set_index("name")
    rank = family.loc["expb.factorial.rank"]
    assert rank["direction"] == "not tested" and pd.isna(rank["p_value"])
    assert rank["reason"] == "invalid (rank_at_heavy and rank_at_light invalid)"
    # every cell has the same ΔNLL: the weight's differences are all 0, no t-test either
    weight = family.loc["expb.factorial.weight"]
    assert weight["family_size"] == 0 and weight["direction"] == "not tested"
    assert weight["reason"] == "no t-test (4 streams; it needs 2 with some spread)"
    ok = run_analysis(factorial_inputs(tmp_path, d), params(gap=0.05), tmp_path / "an2")
    assert all(t["valid"] for t in ok["expb_factorial"][0]["tests"])


def test_runs_of_different_plans_are_not_compared(tmp_path):
    d = {c: np.linspace(1, 2, 4) * 1e-3 for c in CELLS}
    inputs = factorial_inputs(tmp_path, d)
    tok = tokens_table(4, 32, 16, seed=0)
    other = write_expb_factorial(tmp_path / "x", tok, d, per_stream=3)[0]  # low_light, 3 a stream
    shutil.copy(other, inputs["expb_factorial"][0])
    doc = run_analysis(inputs, params(), tmp_path / "an")
    part = doc["parts"]["expb_factorial"]
    assert part["status"] == "missing" and "different streams or counts" in part["reason"]
    without = run_analysis(inputs, {"expb": {"designs": {"study": {"primary": 0.1}}}},
                           tmp_path / "an2")  # fmt: skip
    assert without["parts"]["expb_factorial"]["reason"].startswith("disabled")


def test_factorial_rule_from_config():
    assert FactorialRule.from_mapping({}, "w").max_weight_gap == 0.1
    with pytest.raises(ValueError, match="at most the key 'max_weight_gap'"):
        FactorialRule.from_mapping({"share": 0.1}, "w")
    with pytest.raises(ValueError, match="must be >= 0"):
        FactorialRule.from_mapping({"max_weight_gap": -1}, "w")
