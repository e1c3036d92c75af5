"""moesub.stats on synthetic artefacts with known answers (tests/fixtures_artefacts.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import (
    DPPL_PER_MASS,
    MASS,
    N_LAYERS,
    POLICIES,
    TIME,
    make_study,
    tokens_table,
    write_capture,
    write_emulate,
)
from scipy import stats as sps

from moesub.config import missing_admission_twins, normalize_policy, stage_policies
from moesub.stats import (
    OUTPUT_FILES,
    correlation,
    find_twin,
    median_ci,
    pareto_front,
    run_analysis,
    wilson_ci,
)


def doc_tests(analysis_dir) -> list[dict]:
    return pd.read_parquet(analysis_dir / "tests.parquet").to_dict("records")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    inputs, params = make_study(root / "results")
    doc = run_analysis(inputs, params, root / "analysis")
    tables = {n: pd.read_parquet(root / "analysis" / f"{n}.parquet") for n in OUTPUT_FILES}
    return {"inputs": inputs, "params": params, "doc": doc, "tables": tables, "root": root}


def test_every_part_ok_and_every_file_written(study):
    parts = study["doc"]["parts"]
    # the fixture has no regime table and no planned policy (those parts have their own tests:
    # tests/test_regime.py, tests/test_stats_allocation.py)
    own = ("regime", "allocation")
    assert {p["status"] for n, p in parts.items() if n not in own} == {"ok"}, parts
    for name in OUTPUT_FILES:
        assert (study["root"] / "analysis" / f"{name}.parquet").is_file()
    on_disk = json.loads((study["root"] / "analysis" / "analysis.json").read_text())
    assert on_disk == study["doc"]


def test_mass_hypothesis_r_is_one_by_construction(study):
    res = {r["group"]: r for r in study["doc"]["mass_hypothesis"]}
    first = res["fetches first choice"]
    assert sorted(first["policies"]) == [
        "first_choice",
        "first_choice_lfu",
        "quality",
        "rule_015",
        "rule_015_lfu",
        "rule_tau0.08",
        "speed",
    ]
    assert first["n"] == 7
    assert first["r"] == pytest.approx(1.0, abs=1e-12)
    assert 0.99 <= first["r_ci_lo"] <= first["r_ci_hi"] <= 1.0 + 1e-12
    assert abs(first["r_bias"]) < 1e-5  # r is ~1 in every resample
    assert first["n_boot_valid"] == study["params"]["n_boot"]
    # the policies are nested sweeps: no parametric p-value or Fisher interval across them
    assert "p" not in first and "rho_p" not in first
    # lossless policies and substitute_all are rows of mass_points, not points of r, each
    # with the reason; substitute_all is set against the line through the points instead
    assert set(res) == {"fetches first choice"}
    out = {e["policy"]: e["why"] for e in first["excluded"]}
    assert set(out) == {"fetch_every_miss", "host_compute", "substitute_all"}
    assert out["host_compute"].startswith("lossless")
    sub = first["substitute_all"]
    assert sub["mass"] == pytest.approx(MASS["substitute_all"] / N_LAYERS)
    assert sub["dppl_pct"] == pytest.approx(150.0)
    # the line: Δppl = DPPL_PER_MASS * N_LAYERS * mass per token-layer, through 0
    assert sub["line_dppl_pct"] == pytest.approx(DPPL_PER_MASS * MASS["substitute_all"])
    assert sub["nearest"] == "first_choice"
    pts = study["tables"]["mass_points"].set_index("policy")
    assert sorted(pts.index[pts["used"]]) == sorted(first["policies"])
    for name in first["policies"]:
        assert pts.loc[name, "mass_per_token_layer"] == pytest.approx(MASS[name] / N_LAYERS)
        assert pts.loc[name, "dppl_pct"] == pytest.approx(DPPL_PER_MASS * MASS[name])
    # masses 0.03 | 0.06-0.09 per token-layer: the gap 0.03 is 50% of the range > 20%
    assert [c["policies"] for c in first["clusters"]] == [
        ["rule_tau0.08"],
        ["first_choice", "first_choice_lfu", "quality", "rule_015", "rule_015_lfu", "speed"],
    ]
    assert first["within_r"] == pytest.approx(1.0, abs=1e-9)


def test_mass_hypothesis_matches_scipy_on_other_data(tmp_path):
    """Non-degenerate r: three policies with arbitrary per-token ΔNLL; r must equal scipy's."""
    tok = tokens_table(6, 40, 10, seed=3)
    rng = np.random.default_rng(5)
    inputs = {"capture_tokens": [str(write_capture(tmp_path, tok))], "emulate": []}
    policies = {}
    expected = []
    for i, (name, rule) in enumerate(
        [("a", "first_choice"), ("b", "threshold"), ("c", "threshold"), ("d", "first_choice")]
    ):
        pol = normalize_policy(name, {"rule": rule, "tau": 0.1 * (i + 1)})
        policies[name] = pol
        mass = rng.uniform(0, 0.5 + i, tok["nll"].size)
        dnll = rng.normal(0.05 * (3 - i) ** 2, 0.02, tok["nll"].size)
        inputs["emulate"].append(
            str(write_emulate(tmp_path, name, pol, tok, tok["nll"] + dnll, mass))
        )
        ok = ~np.isnan(tok["nll"])
        expected.append((mass.mean(), 100 * math.expm1(dnll[ok].mean())))
    params = {"policies": policies, "n_boot": 50, "mass_min_points": 4}
    doc = run_analysis(inputs, params, tmp_path / "an")
    res = next(r for r in doc["mass_hypothesis"] if r["group"] == "fetches first choice")
    x, y = np.array(expected).T
    assert res["r"] == pytest.approx(sps.pearsonr(x, y)[0], abs=1e-9)
    # four points are too few at the default minimum (5): r is not reported, and says why
    doc = run_analysis(inputs, {**params, "mass_min_points": 5}, tmp_path / "an5")
    (res,) = doc["mass_hypothesis"]
    assert res["r"] is None and res["r_ci_lo"] is None
    assert res["reason"].startswith("not reported: 4 policies substitute here, r needs at least 5")
    (test,) = [t for t in doc_tests(tmp_path / "an5") if t["kind"] == "mass_hypothesis"]
    assert test["direction"] == "not tested" and math.isnan(test["p_value"])
    assert doc["dppl_base"] == {tmp_path.name: {"0.25": "captured exact NLL"}}


def test_mass_hypothesis_without_enough_substituting_policies(tmp_path):
    """Mostly lossless policies: they are not points of r, and one policy that substitutes is
    no correlation (a run once printed r = -1 over 5 policies, 4 of them lossless)."""
    names = ["fetch_every_miss", "host_compute", "rule_015", "substitute_all"]
    inputs, params = make_study(tmp_path / "r", names=names)
    doc = run_analysis(inputs, params, tmp_path / "an")
    (res,) = doc["mass_hypothesis"]
    assert res["policies"] == ["rule_015"] and res["r"] is None
    assert res["reason"].startswith("not reported: 1 policy substitutes here")
    assert {e["policy"] for e in res["excluded"]} == {
        "fetch_every_miss",
        "host_compute",
        "substitute_all",
    }
    claims = {c["claim"]: c for c in doc["claims"]}
    assert claims["mass"]["verdict"] == "cannot decide"
    assert "not reported" in claims["mass"]["details"]


def test_summary_known_values(study):
    s = study["tables"]["summary"].set_index("policy")
    assert sorted(s.index) == sorted(POLICIES)
    assert s.loc["fetch_every_miss", "dppl_pct"] == pytest.approx(0.0, abs=1e-12)
    assert s.loc["rule_015", "dppl_pct"] == pytest.approx(6.0)
    assert s.loc["substitute_all", "dppl_pct"] == pytest.approx(150.0)
    lo, hi = s.loc["rule_015", ["dppl_ci_lo", "dppl_ci_hi"]]
    assert lo < 6.0 < hi
    assert s.loc["rule_015", "dppl_ci_method"] == "bca"
    assert abs(s.loc["rule_015", "dppl_bias"]) < hi - lo
    assert s.loc["rule_015", "dppl_mde_pct"] > 0
    # one mass unit: emulate's per-token sum over layers, divided by L
    assert s.loc["rule_015", "mass_per_token_layer"] == pytest.approx(0.30 / N_LAYERS)
    for name in POLICIES:
        assert s.loc[name, "time_per_token_s"] == pytest.approx(TIME[name])
        assert s.loc[name, "speedup_vs_fetch_every_miss"] == pytest.approx(
            TIME["fetch_every_miss"] / TIME[name]
        )
        assert s.loc[name, "speedup_vs_host_compute"] == pytest.approx(
            TIME["host_compute"] / TIME[name]
        )
    assert s.loc["fetch_every_miss", "gsm8k_accuracy"] == pytest.approx(12 / 20)
    assert s.loc["rule_015", "gsm8k_accuracy"] == pytest.approx(9 / 20)
    assert s.loc["quality", "humaneval_accuracy"] == pytest.approx(6 / 20)
    # 10 slots x 4 layers per token; the fixture substitutes round(10 * mass) of them
    assert s.loc["rule_015", "sub_rate"] == pytest.approx(3 / 40)
    assert s.loc["rule_015", "ppl"] / s.loc["rule_015", "ppl_base"] == pytest.approx(1.06)


def test_per_input_correlation_is_one(study):
    pi = study["tables"]["per_input"]
    sub = pi[pi["policy"].isin(["rule_015", "quality", "substitute_all"])]
    assert set(sub["level"]) == {"stream", "document"}
    assert np.allclose(sub["r"], 1.0)
    assert (sub.loc[sub["level"] == "stream", "n"] == 8).all()
    assert (sub.loc[sub["level"] == "document", "n"] == 32).all()
    host = pi[pi["policy"] == "host_compute"]
    assert host["r"].isna().all() and host["reason"].str.contains("constant").all()
    assert "fetch_every_miss" not in set(pi["policy"])


def _since_and_segment(tok):
    """Brute force, token by token: tokens since the document start and the segment (0: the
    stream's first document, 1: after a change)."""
    since = np.zeros(tok["pos"].size, dtype=np.int64)
    segment = np.zeros(tok["pos"].size, dtype=np.int64)
    for i in range(tok["pos"].size):
        if i == 0 or tok["stream"][i] != tok["stream"][i - 1]:
            start, seg = tok["pos"][i], 0
        elif tok["doc_start"][i]:
            start, seg = tok["pos"][i], 1
        since[i], segment[i] = tok["pos"][i] - start, seg
    return since, segment


def test_admission_bins_boundary_and_first_document(tmp_path):
    """quality = its exact twin minus 0.3 nat on each later document's first token, 0.1 on
    the token after it, 0.05 everywhere in the stream's first document: a boundary token binned
    with the next one, a since counted from 1, or a first document pooled with later ones would
    each mix these values. Documents have irregular lengths (4..23 tokens)."""
    tok = tokens_table(6, 60, 60, seed=2)
    rng = np.random.default_rng(7)
    starts = np.zeros(tok["pos"].size, dtype=bool)
    for s in range(6):  # irregular document starts, the stream's first at pos 0
        cuts = np.cumsum(rng.integers(4, 24, size=10))
        starts[s * 60 + np.concatenate([[0], cuts[cuts < 60]])] = True
    tok["doc_start"] = starts
    tok["doc_id"] = (np.cumsum(starts) - 1).astype(np.int32)
    since, segment = _since_and_segment(tok)
    effect = np.where(segment == 0, 0.05, np.where(since == 0, 0.3, np.where(since == 1, 0.1, 0)))
    names = ["fetch_every_miss", "rule_015", "quality", "rule_015_lfu", "speed", "first_choice"]
    pols = {n: normalize_policy(n, POLICIES[n]) for n in names}
    twin_nll = tok["nll"] + 0.2
    inputs = {"capture_tokens": [str(write_capture(tmp_path, tok))], "emulate": []}
    for n in names:
        nll = tok["nll"] if n == "fetch_every_miss" else twin_nll
        if pols[n]["beta"] > 0:
            nll = twin_nll - effect
        mass = np.full(nll.size, 0.0 if n == "fetch_every_miss" else 0.3)
        inputs["emulate"].append(str(write_emulate(tmp_path, n, pols[n], tok, nll, mass)))
    params = {"policies": pols, "n_boot": 50, "admission_bins": [1, 2, 4, 8, 16, 32, 64]}
    doc = run_analysis(inputs, params, tmp_path / "an")
    adm = pd.read_parquet(tmp_path / "an" / "admission.parquet")
    totals = {(r["policy"], r["segment"]): r for r in doc["admission"]}
    # only the exact twin; speed's only beta-0 relative differs in eviction: named once, in
    # the part's note (no totals), and its pre-registered test is "not measured"
    assert totals[("quality", "all")]["twin"] == "rule_015_lfu"
    assert ("speed", "all") not in totals
    note = doc["parts"]["admission"]["note"]
    assert note.count("speed") == 1 and note.startswith("speed has no exact no-admission twin")
    assert "(first_choice differs in eviction or tau, not an admission effect)" in note
    assert set(adm["policy"]) == {"quality"}
    tests = {t["name"]: t for t in doc_tests(tmp_path / "an")}
    assert not tests["speed"]["measured"] and tests["speed"]["direction"] == "not tested"
    # every row against a brute-force aggregation of the same tokens
    has_nll = ~np.isnan(tok["nll"])
    max_since = int(since[has_nll].max())
    edges = [e for e in params["admission_bins"] if e <= max_since]
    q = adm.set_index(["segment", "bin_label"])
    assert q.index.is_unique and (q["n_tokens"] > 0).all()
    for seg_id, seg in enumerate(["first_document", "after_change"]):
        lo_hi = [(0, 0)] + [
            (e, (edges[i + 1] - 1) if i + 1 < len(edges) else max_since)
            for i, e in enumerate(edges)
        ]
        for lo, hi in lo_hi:
            sel = has_nll & (segment == seg_id) & (since >= lo) & (since <= hi)
            label = "boundary" if hi == 0 else (f"{lo}" if lo == hi else f"{lo}-{hi}")
            if not sel.any():
                assert (seg, label) not in q.index
                continue
            row = q.loc[(seg, label)]
            assert row["n_tokens"] == sel.sum(), (seg, label)
            assert row["dnll_mean"] == pytest.approx(-effect[sel].mean()), (seg, label)
            assert (row["bin_lo"], row["bin_hi"]) == (lo, hi)
    assert q.loc[("after_change", "boundary"), "dnll_mean"] == pytest.approx(-0.3)
    assert q.loc[("after_change", "1"), "dnll_mean"] == pytest.approx(-0.1)
    assert ("first_document", "boundary") not in q.index  # pos 0 has no NLL
    last = q.xs("after_change")["bin_hi"].max()
    assert last == max_since  # the last bin ends at the largest observed distance
    expected = 100 * math.expm1(-effect[has_nll].mean())
    assert totals[("quality", "all")]["dppl_pct_vs_twin"] == pytest.approx(expected)
    first = totals[("quality", "first_document")]
    assert first["dppl_pct_vs_twin"] == pytest.approx(100 * math.expm1(-0.05))
    test = totals[("quality", "all")]
    # the primary estimand: the mean ΔNLL, its interval the Δppl one on the ΔNLL scale
    assert test["dnll_mean"] == pytest.approx(-effect[has_nll].mean())
    assert test["dnll_ci_lo"] == pytest.approx(math.log1p(test["ci_lo"] / 100))
    assert test["dnll_ci_lo"] <= test["dnll_mean"] <= test["dnll_ci_hi"]
    # every stream gains: the bootstrap never reaches 0 (p at its floor, 1 / n_boot), and the
    # two-sided Wilcoxon sensitivity line reaches its floor 2 * 2**-6
    assert test["p_value"] == pytest.approx(1 / 50)
    assert test["wilcoxon_min_p"] == pytest.approx(2**-5)
    assert test["wilcoxon_p"] == pytest.approx(2**-5)
    assert test["mde_dnll"] > 0 and test["ci_method"] in ("bca", "basic")
    # the profile after a change: the first 16 tokens hold the boundary (-0.3) and the next
    # token (-0.1); later tokens have no effect
    early, late = (
        totals[("quality", "after_change_early")],
        totals[("quality", "after_change_late")],
    )
    sel = has_nll & (segment == 1) & (since < 16)
    assert early["n_tokens"] == sel.sum()
    assert early["dnll_mean"] == pytest.approx(-effect[sel].mean())
    assert late["dnll_mean"] == pytest.approx(0.0, abs=1e-12)
    assert test["profile"] == "immediate" and test["early_tokens"] == 16


def test_find_twin_only_exact():
    pol = normalize_policy("q", {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5})
    cands = {
        "t_lru": normalize_policy("t_lru", {"rule": "threshold", "tau": 0.15}),
        "t_other_tau": normalize_policy("x", {"rule": "threshold", "tau": 0.2, "eviction": "lfu"}),
        "fc": normalize_policy("fc", {"rule": "first_choice", "eviction": "lfu"}),
    }
    twin, why = find_twin(pol, cands)
    assert twin is None
    assert "t_lru" in why and "t_other_tau" in why and "not an admission effect" in why
    assert "{rule: threshold, tau: 0.15, eviction: lfu}" in why
    cands["t_lfu"] = normalize_policy(
        "t_lfu", {"rule": "threshold", "tau": 0.15, "eviction": "lfu"}
    )
    assert find_twin(pol, cands) == ("t_lfu", None)
    assert find_twin(pol, {"fc": cands["fc"]})[0] is None


def test_missing_twins_warned_at_parse_time():
    pols = {n: normalize_policy(n, POLICIES[n]) for n in ("rule_015", "quality", "speed")}
    assert missing_admission_twins(pols) == [
        "quality has no exact no-admission twin (add a policy "
        "{rule: threshold, tau: 0.15, eviction: lfu}): its admission effect will not be measured",
        "speed has no exact no-admission twin (add a policy {rule: first_choice, eviction: lfu}): "
        "its admission effect will not be measured",
    ]
    full = {n: normalize_policy(n, p) for n, p in POLICIES.items()}
    assert missing_admission_twins(full) == []
    with pytest.warns(UserWarning, match="quality has no exact no-admission twin"):
        stage_policies({"emulate": {"policies": ["rule_015", "quality"]}}, full)


def test_pareto_front():
    cost = [1.0, 2.0, 3.0, 2.0, 4.0, np.nan, 1.0]
    loss = [5.0, 3.0, 1.0, 4.0, 1.0, 0.0, 5.0]
    # 3 dominated by 1 (same cost, lower loss), 4 by 2 (same loss, lower cost), NaN never,
    # duplicates (0 and 6) do not dominate each other
    assert pareto_front(cost, loss).tolist() == [True, True, True, False, False, False, True]


def test_speed_quality_frontier(study):
    sq = study["tables"]["speed_quality"]
    eng = sq[sq["source"] == "engine"].set_index("policy")
    # fixture: rule_015 (13 ms, +6%) is beaten by quality (12 ms, +4.8%)
    assert not eng.loc["rule_015", "frontier"]
    assert not eng.loc["first_choice", "frontier"]  # speed: 10 ms, +5.6%
    assert eng.loc["quality", "frontier"] and eng.loc["speed", "frontier"]
    assert eng.loc["fetch_every_miss", "frontier"]
    assert not eng.loc["host_compute", "frontier"]  # slower than fetch_every_miss at 0%
    assert set(sq["source"]) == {"engine", "simulate"}
    sve = study["tables"]["sim_vs_engine"]
    # the fixture prices the engine's tokens at 1.05 x measured, the simulator's at 1.1 x
    assert np.allclose(sve["rel_error"], 0.05)
    assert np.allclose(sve["token_set_effect"], 1.1 / 1.05 - 1)
    assert not sve["contended"].any() and np.allclose(sve["cpu_share"], 0.95)
    assert np.allclose(sve["other_cores"], 0.01)
    # and at the disk's speed while each run read, 1.02 x measured
    assert np.allclose(sve["rel_error_at_run_disk"], 0.02)
    doc = study["doc"]["sim_vs_engine"][0]
    assert doc["median_abs_rel_error"] == pytest.approx(0.05) and doc["n_contended"] == 0
    assert doc["median_abs_rel_error_at_run_disk"] == pytest.approx(0.02)
    assert doc["n_at_run_disk"] == len(sve)
    assert doc["n_within"] == doc["n_within_at_run_disk"] == len(sve)  # 5% and 2%: within 10%
    assert doc["median_abs_token_set_effect"] == pytest.approx(1.1 / 1.05 - 1)
    # and at the machine's speed while each ran too, 1.01 x measured
    assert np.allclose(sve["rel_error_at_run_speed"], 0.01) and np.allclose(sve["run_speed"], 1.03)
    assert doc["n_at_run_speed"] == doc["n_within_at_run_speed"] == len(sve)
    assert doc["max_abs_rel_error_at_run_speed"] == pytest.approx(0.01)
    # over each run's 4 streams resampled (priced 4% either side of its ratio in two): an
    # interval about its error, within 10%; the streams' sums are not passed on
    assert (sve["rel_error_ci_lo"] < sve["rel_error"]).all()
    assert (sve["rel_error_ci_hi"] > sve["rel_error"]).all()
    assert (sve["rel_error_ci_lo"] > -0.1).all() and (sve["rel_error_ci_hi"] < 0.1).all()
    assert "stream_time_s" not in sve.columns and not sve["rel_error_ci_crosses"].any()
    assert (doc["n_with_ci"], doc["n_within_ci_beyond"], doc["n_outside_ci_inside"]) == (
        len(sve), 0, 0,
    )  # fmt: skip
    # and from the jackknife over the engine stage's rounds, the calibration refitted: the t
    # interval of the errors with each round left out, the calibration alone's share of it
    from fixtures_artefacts import JACKKNIFE_ALONE, JACKKNIFE_JOINT

    from moesub.stats import AnalysisParams
    from moesub.stats.intervals import t_interval

    level = AnalysisParams.from_mapping(study["params"]).ci_level
    lo, hi, se = t_interval(0.05, np.array(JACKKNIFE_JOINT), level)
    assert np.allclose(sve["rel_error_jk_lo"].astype(float), lo, rtol=1e-12)
    assert np.allclose(sve["rel_error_jk_hi"].astype(float), hi, rtol=1e-12)
    share = (t_interval(0.05, np.array(JACKKNIFE_ALONE), level)[2] / se) ** 2
    assert np.allclose(sve["calibration_share"].astype(float), share, rtol=1e-12)
    assert 0 < share < 1 and "jackknife_rel_error" not in sve.columns
    reaches = hi > 0.1  # within 10%, its interval reaching beyond it or not
    assert (doc["n_with_jk"], doc["n_within_jk_beyond"], doc["n_outside_jk_inside"]) == (
        len(sve), len(sve) * reaches, 0,
    )  # fmt: skip
    assert doc["median_calibration_share"] == pytest.approx(share, rel=1e-12)


def test_generation_wilson_and_correlation(study):
    gen = study["tables"]["generation"].set_index(["task", "policy"])
    row = gen.loc[("gsm8k", "fetch_every_miss")]
    assert row["n"] == 20 and row["accuracy"] == pytest.approx(0.6)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((0.38658, 0.78119), abs=1e-4)
    assert row["agreement"] == 1.0 and row["mass_agree_reason"].startswith("undefined")
    # fixture: agreement = 1 - mass exactly -> rho = -1
    assert gen.loc[("humaneval", "rule_015"), "mass_agree_rho"] == pytest.approx(-1.0)


def test_small_helpers():
    assert wilson_ci(0, 10)[0] == 0.0 and wilson_ci(10, 10)[1] == 1.0
    assert wilson_ci(0, 0) == (None, None)
    lo, hi = median_ci(np.arange(101.0))
    assert lo < 50 < hi and hi - lo < 30
    c = correlation([1, 2], [3, 4])
    assert c["r"] is None and "n = 2" in c["reason"]
    c = correlation([1, 1, 1, 1], [1, 2, 3, 4])
    assert c["r"] is None and "constant" in c["reason"]


def test_missing_inputs_do_not_crash(tmp_path):
    doc = run_analysis({}, {"policies": {}}, tmp_path / "empty")
    assert all(p["status"] == "missing" for p in doc["parts"].values()), doc["parts"]
    for name in OUTPUT_FILES:
        assert (tmp_path / "empty" / f"{name}.parquet").is_file()
    # only simulate: the speed/quality part still needs Δppl
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss", "rule_015"])
    doc = run_analysis({"simulate": inputs["simulate"]}, params, tmp_path / "sim_only")
    assert doc["parts"]["simulate"]["status"] == "ok"
    assert doc["parts"]["summary"]["status"] == "ok"
    assert doc["parts"]["speed_quality"]["status"] == "missing"
    assert doc["parts"]["expb"]["status"] == "missing"


def test_bad_arguments_raise_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'emulated'"):
        run_analysis({"emulated": []}, {}, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="inputs\\['emulate'\\]"):
        run_analysis({"emulate": [tmp_path / "nope.parquet"]}, {}, tmp_path / "x")
    with pytest.raises(ValueError, match="n_boot"):
        run_analysis({}, {"n_boot": 1}, tmp_path / "x")
    with pytest.raises(ValueError, match="designs"):
        run_analysis({}, {"expb": {"alpha": 0.05}}, tmp_path / "x")
    with pytest.raises(ValueError, match="rule"):
        run_analysis({}, {"policies": {"p": {"rule": "nope"}}}, tmp_path / "x")


def test_deterministic(tmp_path, study):
    doc = run_analysis(study["inputs"], study["params"], tmp_path / "again")
    assert doc == study["doc"]
    again = pd.read_parquet(tmp_path / "again" / "summary.parquet")
    pd.testing.assert_frame_equal(again, study["tables"]["summary"])


def test_models_are_analysed_separately(tmp_path):
    """Two models' artefacts in one call: per-model results, a `model` column everywhere."""
    inputs_a, params = make_study(
        tmp_path / "results", model="a", names=["fetch_every_miss", "rule_015"]
    )
    inputs_b, _ = make_study(
        tmp_path / "results",
        model="b",
        names=["fetch_every_miss", "rule_015"],
        expb_case="no_evidence",
    )
    inputs = {k: inputs_a[k] + inputs_b[k] for k in inputs_a}
    inputs["engine_bench"] = inputs_a["engine_bench"]
    doc = run_analysis(inputs, params, tmp_path / "an")
    assert doc["models"] == ["a", "b"]
    matched = [e for e in doc["expb"] if e["design"] == "matched"]
    assert [(e["model"], e["decision"]["outcome"]) for e in matched] == [
        ("a", "heavy worse"),
        ("b", "heavy not worse"),
    ]
    summary = pd.read_parquet(tmp_path / "an" / "summary.parquet")
    assert summary[["model", "policy"]].values.tolist() == [
        ["a", "fetch_every_miss"],
        ["a", "rule_015"],
        ["b", "fetch_every_miss"],
        ["b", "rule_015"],
    ]
    assert np.allclose(summary.loc[summary["policy"] == "rule_015", "dppl_pct"], 6.0)
    assert doc["parts"]["quality"]["status"] == "ok"
    assert {r["model"] for r in doc["provenance"] if r["kind"] == "emulate"} == {"a", "b"}
    # one row per model: geometry from the capture metadata / summary, capacity per fraction
    models = pd.read_parquet(tmp_path / "an" / "models.parquet")
    assert models["model"].tolist() == ["a", "b"]
    assert models[["num_experts", "top_k", "num_layers"]].values.tolist() == [[512, 10, 4]] * 2
    assert [list(c) for c in models["capacities"]] == [[128], [128]]
    assert models["source"].tolist() == ["embedded", "embedded"]


def test_mass_per_token_layer_from_metadata_or_layer_mass(tmp_path):
    """emulate's mass is summed over layers: divided by num_layers (metadata) or by the length
    of layer_mass; a file with neither is refused before any work, naming the problem."""
    import pyarrow.parquet as pq

    from moesub.io import read_metadata, write_parquet

    tok = tokens_table(3, 20, 10, seed=4)
    pols = {n: normalize_policy(n, POLICIES[n]) for n in ("fetch_every_miss", "rule_015")}
    inputs = {"capture_tokens": [str(write_capture(tmp_path, tok))], "emulate": []}
    for n, pol in pols.items():
        mass = np.full(tok["nll"].size, 0.8 if n == "rule_015" else 0.0)
        path = write_emulate(tmp_path, n, pol, tok, tok["nll"], mass)
        meta = {**read_metadata(path), "num_layers": N_LAYERS}
        write_parquet(pq.read_table(path).drop(["layer_mass"]), path, metadata=meta)
        inputs["emulate"].append(str(path))
    run_analysis(inputs, {"policies": pols, "n_boot": 20}, tmp_path / "an")
    s = pd.read_parquet(tmp_path / "an" / "summary.parquet").set_index("policy")
    assert s.loc["rule_015", "mass_per_token_layer"] == pytest.approx(0.8 / N_LAYERS)
    path = inputs["emulate"][1]
    meta = {k: v for k, v in read_metadata(path).items() if k != "num_layers"}
    write_parquet(pq.read_table(path).replace_schema_metadata(None), path, metadata=meta)
    with pytest.raises(ValueError, match="neither num_layers metadata nor a layer_mass column"):
        run_analysis(inputs, {"policies": pols, "n_boot": 20}, tmp_path / "an2")


def test_the_bench_errors_interval_over_its_rounds(tmp_path):
    """A policy's error with an interval over its rounds resampled: its error exactly, no width
    where every round is priced alike, around the error where they differ (wider with more
    noise), none under 3 rounds; the analysis' table keeps the bounds, not the rounds' sums."""
    import pyarrow as pa

    from moesub.io import write_parquet
    from moesub.stats import AnalysisParams
    from moesub.stats.pricing_error import engine_bench, error_interval

    p = AnalysisParams(n_boot=2000)
    time_s = np.array([2.0, 2.4, 1.8, 2.2, 2.1, 1.9, 2.6, 2.0])
    alike = error_interval(time_s, 0.9 * time_s, p, "alike", source="engine_bench")
    assert alike.estimate == pytest.approx(-0.1, rel=1e-12)
    assert alike.ci_lo == pytest.approx(-0.1, rel=1e-9) and alike.ci_hi == pytest.approx(-0.1)
    ratios = np.array([0.95, 0.85, 1.0, 0.8, 0.9, 0.93, 0.82, 0.97])
    # the key and the stream the bench's table uses
    noisy = error_interval(time_s, ratios * time_s, p, "a/cpu", source="engine_bench")
    assert noisy.estimate == pytest.approx((ratios * time_s).sum() / time_s.sum() - 1, rel=1e-12)
    assert noisy.ci_lo < noisy.estimate < noisy.ci_hi
    # the engine stage's errors draw their resamples from a stream of their own
    stage = error_interval(time_s, ratios * time_s, p, "a/cpu", source="sim_vs_engine")
    assert stage.estimate == noisy.estimate and stage.ci_lo != noisy.ci_lo
    noisier_s = (0.9 + 2 * (ratios - 0.9)) * time_s
    noisier = error_interval(time_s, noisier_s, p, "noisy", source="engine_bench")
    assert noisier.ci_hi - noisier.ci_lo > 1.5 * (noisy.ci_hi - noisy.ci_lo)
    assert error_interval(time_s[:2], time_s[:2], p, "two", source="engine_bench") is None
    rows = [
        {"policy": "a", "device": "cpu", "sim_rel_error": noisy.estimate,
         "round_time_s": time_s.tolist(), "round_priced_s": (ratios * time_s).tolist()},
        {"policy": "b", "device": "cpu", "sim_rel_error": 0.0,
         "round_time_s": [1.0, 1.0], "round_priced_s": [1.0, 1.0]},
    ]  # fmt: skip
    path = write_parquet(pa.Table.from_pylist(rows), tmp_path / "cpu.parquet")
    table = engine_bench([str(path)], p).table.set_index("policy")
    assert "round_time_s" not in table.columns and "round_priced_s" not in table.columns
    assert table.loc["a", "sim_rel_error_ci_lo"] == pytest.approx(noisy.ci_lo, rel=1e-12)
    assert table.loc["a", "sim_rel_error_ci_hi"] == pytest.approx(noisy.ci_hi, rel=1e-12)
    assert pd.isna(table.loc["b", "sim_rel_error_ci_lo"])
    # outside 10% (-10.4%), its interval reaching inside; none for the row with 2 rounds
    assert noisy.estimate < -0.1 < noisy.ci_hi
    assert table.loc["a", "sim_rel_error_ci_crosses"] == True  # noqa: E712 (a pandas bool)
    assert pd.isna(table.loc["b", "sim_rel_error_ci_crosses"])
    # a bench from before the rounds' sums: no bounds
    old = write_parquet(pa.Table.from_pylist([{k: v for k, v in rows[0].items()
                                               if not k.startswith("round")}]),
                        tmp_path / "old.parquet")  # fmt: skip
    assert "sim_rel_error_ci_lo" not in engine_bench([str(old)], p).table.columns
    # the jackknife with the calibration refitted: the t interval of the errors with each round
    # left out, and the calibration alone's share of its variance; NA under 3 rounds
    from moesub.stats.intervals import t_interval

    joint, alone = [-0.12, -0.08, -0.10, -0.11], [-0.11, -0.09, -0.10, -0.10]
    keys = ("jackknife_rel_error", "calibration_jackknife_rel_error")
    jack = [{**rows[0], **dict(zip(keys, (joint, alone), strict=True))},
            {**rows[1], **dict.fromkeys(keys, [0.0, 0.0])}]  # fmt: skip
    path = write_parquet(pa.Table.from_pylist(jack), tmp_path / "jack.parquet")
    table = engine_bench([str(path)], p).table.set_index("policy")
    lo, hi, se = t_interval(noisy.estimate, np.array(joint), p.ci_level)
    assert table.loc["a", "sim_rel_error_jk_lo"] == pytest.approx(lo, rel=1e-12)
    assert table.loc["a", "sim_rel_error_jk_hi"] == pytest.approx(hi, rel=1e-12)
    assert lo < -0.1 < hi and table.loc["a", "sim_rel_error_jk_crosses"] == True  # noqa: E712
    se_alone = t_interval(noisy.estimate, np.array(alone), p.ci_level)[2]
    assert table.loc["a", "calibration_share"] == pytest.approx((se_alone / se) ** 2, rel=1e-12)
    assert pd.isna(table.loc["b", "sim_rel_error_jk_lo"])
    assert pd.isna(table.loc["b", "calibration_share"])
    assert "jackknife_rel_error" not in table.columns
    assert "sim_rel_error_jk_lo" not in engine_bench([str(old)], p).table.columns
    # the calibration runs' errors from each bench's metadata, by device; none in an older one
    errors = {"cal_fetch": -0.109, "cal_host": 0.007}
    meta = {"device": "cpu", "calibration_run_errors": errors}
    kept = write_parquet(pa.Table.from_pylist(rows), tmp_path / "kept.parquet", metadata=meta)
    assert engine_bench([str(kept)], p).status["calibration_run_errors"] == {"cpu": errors}
    assert engine_bench([str(old)], p).status["calibration_run_errors"] == {}
