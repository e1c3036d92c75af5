"""Degeneration: the measures of one token sequence against hand-made sequences and brute-force
definitions (`moesub.generate.degeneration`), and their statistics and report section on
synthetic artefacts with known answers (`moesub.stats.degeneration`, `moesub.report`)."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import DPPL_PER_MASS, MASS, POLICIES, make_study
from scipy import stats as sps

from moesub.generate.degeneration import (
    DEGENERATION_MEASURES,
    check_loop_definition,
    longest_repeat,
    measures,
    repeated_ngram_share,
    tail_loop,
)
from moesub.report import render_report
from moesub.report.load import disabled_parts
from moesub.stats import run_analysis, wilson_ci
from moesub.stats.degeneration import MEASURES


# --------------------------------------------------------------------------- measures
def test_repeated_ngram_share_by_hand():
    # 4-grams of 1 2 3 4 1 2 3 4: 1234 2341 3412 4123 1234 -> one of five repeats an earlier one
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    assert repeated_ngram_share(np.arange(50)) == 0.0  # nothing repeats
    assert repeated_ngram_share([7] * 10) == pytest.approx(6 / 7)  # 7 grams, all the same
    assert repeated_ngram_share([1, 2, 1, 2], n=2) == pytest.approx(1 / 3)  # 12 21 12
    assert math.isnan(repeated_ngram_share([1, 2, 3]))  # no 4-gram at all
    with pytest.raises(ValueError, match="n must be"):
        repeated_ngram_share([1, 2], n=0)


def test_longest_repeat_by_hand():
    assert longest_repeat([1, 2, 3, 9, 1, 2, 3, 8]) == 3  # "1 2 3" twice, apart
    assert longest_repeat([1, 2, 1, 2, 1]) == 3  # "1 2 1" at 0 and 2: overlaps count
    assert longest_repeat([5] * 6) == 5
    assert longest_repeat(np.arange(30)) == 0 and longest_repeat([]) == 0
    with pytest.raises(ValueError, match="1-D"):
        longest_repeat([[1, 2], [3, 4]])


def brute_longest_repeat(t: list[int]) -> int:
    n = len(t)
    for m in range(n - 1, 0, -1):
        seen = [tuple(t[i : i + m]) for i in range(n - m + 1)]
        if len(set(seen)) < len(seen):
            return m
    return 0


def brute_tail_loop(t: list[int], window: int, max_period: int) -> tuple[bool, int | None, int]:
    n = len(t)
    for p in range(1, max_period + 1):
        if n >= window and all(t[i] == t[i - p] for i in range(n - window + p, n)):
            start = n - window  # walk back while the period holds
            while start > 0 and start - 1 + p < n and t[start - 1] == t[start - 1 + p]:
                start -= 1
            return True, p, n - start
    return False, None, 0


def test_measures_equal_brute_force_on_random_sequences():
    rng = np.random.default_rng(0)
    loops = 0
    for case in range(300):
        n = int(rng.integers(0, 40))
        t = rng.integers(0, 3, n).tolist()  # small alphabet: many repeats
        if case % 3 == 0 and n > 4:  # append a cycle so that loops occur
            p = int(rng.integers(1, 6))
            t = t + (rng.integers(0, 3, p).tolist() * 8)[: int(rng.integers(p, 30))]
        assert longest_repeat(t) == brute_longest_repeat(t), t
        grams = [tuple(t[i : i + 4]) for i in range(len(t) - 3)]
        if grams:
            assert repeated_ngram_share(t) == pytest.approx(1 - len(set(grams)) / len(grams))
        loop = tail_loop(t, 12, 6)
        assert (loop.ends_in_loop, loop.period, loop.tokens) == brute_tail_loop(t, 12, 6), t
        loops += loop.ends_in_loop
    assert 20 < loops < 200  # both outcomes exercised


def test_tail_loop_by_hand():
    prefix = [9, 8, 7, 6, 5, 4]
    looped = prefix + [1, 2, 3] * 10  # 30 looping tokens after a prefix that breaks the cycle
    loop = tail_loop(looped, window=12, max_period=6)
    assert (loop.ends_in_loop, loop.period, loop.tokens) == (True, 3, 30)
    assert tail_loop([1] * 20, 8, 4).period == 1  # the smallest period, not 2 or 4
    assert not tail_loop(list(range(40)), 12, 6).ends_in_loop  # no repetition
    # the cycle repeats only 1.5 times within the window: not a loop
    assert not tail_loop(prefix * 3 + [1, 2, 3, 4, 5, 6, 7, 8] + [1, 2, 3, 4], 12, 6).ends_in_loop
    assert not tail_loop([1, 2, 3, 4, 5, 6, 7] * 5, 12, 6).ends_in_loop  # period 7 > 6
    assert tail_loop([1, 2, 3, 4, 5, 6, 7] * 5, 14, 7).ends_in_loop
    assert not tail_loop([1] * 5, 8, 4).ends_in_loop  # shorter than the window
    got = measures(looped, 12, 6)
    assert set(got) == set(DEGENERATION_MEASURES)
    assert got["ends_in_loop"] == 1.0 and got["loop_period"] == 3 and got["loop_tokens"] == 30
    assert got["longest_repeat"] == 27 and got["rep4"] == pytest.approx(1 - 9 / 33)
    assert math.isnan(measures(list(range(20)), 12, 6)["loop_period"])


@pytest.mark.parametrize(
    "window, max_period, match",
    [(1, 1, "loop_window"), (12, 7, "loop_max_period"), (12, 0, "loop_max_period"),
     (True, 1, "loop_window"), (12, 2.0, "loop_max_period")],
)  # fmt: skip
def test_loop_definition_is_checked(window, max_period, match):
    with pytest.raises(ValueError, match=match):
        check_loop_definition(window, max_period)


# --------------------------------------------------------------------------- statistics
@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("degeneration")
    inputs, params = make_study(root / "results")
    doc = run_analysis(inputs, params, root / "analysis")
    table = pd.read_parquet(root / "analysis" / "degeneration.parquet")
    return root, inputs, params, doc, table


def row(table: pd.DataFrame, policy: str, measure: str) -> dict:
    hit = table[(table["policy"] == policy) & (table["measure"] == measure)]
    assert len(hit) == 1
    return hit.iloc[0].to_dict()


def test_tested_measures_are_the_generators():
    assert set(MEASURES) <= set(DEGENERATION_MEASURES)


def test_degeneration_known_values(study):
    _, _, _, doc, table = study
    assert doc["parts"]["degeneration"] == {"status": "ok"}
    assert len(table) == 3 * len(POLICIES) and set(table["task"]) == {"continuation"}
    n = 20
    # first_choice, m = 0.36: 2 + 4 = 6 of 20 loop; the baseline 2 (4 discordant, all one way)
    loop = row(table, "first_choice", "ends_in_loop")
    assert (loop["n"], loop["mean"], loop["baseline_mean"]) == (n, 0.3, 0.1)
    assert (loop["ci_lo"], loop["ci_hi"]) == pytest.approx(wilson_ci(6, n, 0.95))
    assert loop["ci_method"] == "wilson" and loop["diff"] == pytest.approx(0.2)
    assert (loop["test"], loop["n_nonzero"]) == ("sign", 4)
    assert loop["p_raw"] == pytest.approx(2 / 16) and loop["min_p"] == pytest.approx(2 / 16)
    # rep4: 20 distinct positive differences 0.0036 (i + 1): exact Wilcoxon two-sided 2 / 2^20
    rep = row(table, "first_choice", "rep4")
    diffs = MASS["first_choice"] * (np.arange(n) + 1) / 100
    assert rep["diff"] == pytest.approx(diffs.mean())
    assert rep["diff_ci_lo"] < rep["diff"] < rep["diff_ci_hi"]
    assert rep["ci_lo"] < rep["mean"] < rep["ci_hi"] and rep["ci_method"] in ("bca", "basic")
    assert (rep["test"], rep["n_nonzero"]) == ("wilcoxon", n)
    assert rep["p_raw"] == pytest.approx(2 / 2**n) and rep["min_p"] == pytest.approx(2 / 2**n)
    # longest repeat: a constant difference round(20 m) = 7 on every prompt (ties)
    span = row(table, "first_choice", "longest_repeat")
    assert span["diff"] == pytest.approx(7.0) and span["diff_ci_lo"] == pytest.approx(7.0)
    tied = sps.wilcoxon(np.full(n, 7.0), zero_method="wilcox").pvalue
    assert span["p_raw"] == pytest.approx(tied) and span["p_raw"] < 1e-3
    # Δppl beside it, from the quality part (exact by construction)
    assert loop["dppl_pct"] == pytest.approx(DPPL_PER_MASS * MASS["first_choice"])
    assert loop["dppl_ci_lo"] <= loop["dppl_pct"] <= loop["dppl_ci_hi"]
    # the baseline: its own means, nothing to pair with
    base = row(table, "fetch_every_miss", "ends_in_loop")
    assert base["mean"] == pytest.approx(0.1) and base["dppl_pct"] == 0.0
    assert pd.isna(base["test"]) and base["n_pairs"] == 0
    # host_compute (mass 0) equals the baseline on every prompt: no difference to test
    same = row(table, "host_compute", "rep4")
    assert (same["diff"], same["n_nonzero"], same["p_raw"]) == (0.0, 0, 1.0)


def test_paired_tests_in_the_exploratory_family(study):
    """Every paired test is a row of tests.parquet in the exploratory family, its raw p the
    table's and its adjusted p Benjamini-Hochberg's over the whole family (scipy's)."""
    root, _, _, doc, table = study
    tests = pd.read_parquet(root / "analysis" / "tests.parquet")
    degen = tests[tests["kind"] == "degeneration"]
    assert len(degen) == 3 * (len(POLICIES) - 1) and "degeneration" not in doc
    assert set(degen["family"]) == {"exploratory"}
    assert set(degen["adjustment"]) == {"Benjamini-Hochberg"}
    paired = table[table["test"].notna()].set_index("test_name")
    assert sorted(paired.index) == sorted(degen["name"])  # one test per row, names unique
    raw = degen.set_index("name")["p_value"]
    assert np.allclose(raw[paired.index], paired["p_raw"], rtol=0, atol=0)
    family = tests[(tests["family"] == "exploratory") & tests["p_value"].notna()]
    bh = sps.false_discovery_control(family["p_value"].to_numpy(), method="bh")
    assert np.allclose(family["p_adjusted"], bh, rtol=1e-12)
    assert (degen["family_size"] == len(family)).all()
    loop = degen[degen["name"] == "continuation: first_choice share of continuations ending in a "
                                  "loop vs the baseline"].iloc[0]  # fmt: skip
    assert loop["p_value"] == pytest.approx(0.125) and loop["p_adjusted"] >= 0.125
    assert loop["estimate"] == pytest.approx(0.2) and loop["unit"] == "prompts"
    assert loop["n_units"] == 20 and loop["min_p"] == pytest.approx(2 / 16)
    assert pd.isna(loop["ci_lo"]) and "prompt bootstrap" in loop["sensitivity"]
    # the MDE of the loop share's mean difference: 4 differences of +1 in 20 prompts
    d = np.r_[np.ones(4), np.zeros(16)]
    mde = (sps.norm.ppf(0.975) + sps.norm.ppf(0.8)) * d.std(ddof=1) / math.sqrt(20)
    assert loop["mde"] == pytest.approx(mde)


def test_continuation_is_not_graded_in_the_generation_table(study):
    root = study[0]
    gen = pd.read_parquet(root / "analysis" / "generation.parquet")
    cont = gen[gen["task"] == "continuation"]
    assert len(cont) == len(POLICIES)
    assert (cont["n"] == 0).all() and (cont["n_missing"] == 0).all()
    assert cont["accuracy"].isna().all() and cont["agreement"].notna().all()


def test_degeneration_missing_without_measures(tmp_path):
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss", "rule_015"])
    inputs["generate"] = [p for p in inputs["generate"] if "continuation" not in p]
    doc = run_analysis(inputs, params, tmp_path / "a")
    assert doc["parts"]["degeneration"]["status"] == "missing"
    assert pd.read_parquet(tmp_path / "a" / "degeneration.parquet").empty
    html = render_report(tmp_path / "a", {}, tmp_path / "report.html").read_text()
    assert "Degeneration of free continuations: not available" in html


def test_no_generate_tasks_disables_the_degeneration_too():
    off = disabled_parts({"generate": {"tasks": {}}})
    assert off["degeneration"] == off["generation"] == "disabled in the config (generate.tasks: {})"


def test_report_with_the_continuation_only(tmp_path):
    """No graded task: the generation figure says so, the degeneration section has it all."""
    inputs, params = make_study(tmp_path / "r", names=["fetch_every_miss", "rule_015"])
    inputs["generate"] = [p for p in inputs["generate"] if "continuation" in p]
    run_analysis(inputs, params, tmp_path / "a")
    html = render_report(tmp_path / "a", {}, tmp_path / "report.html").read_text()
    assert '<table id="degeneration-table">' in html and 'id="fig-generation"' in html
    assert "accuracy [" not in html  # no accuracy column in the policy table


def test_report_section(study):
    root, _, _, _, table = study
    html = render_report(root / "analysis", {}, root / "report.html").read_text()
    section = html[html.index('id="degeneration-section"') :]
    cells = re.search(r'<table id="degeneration-table">(.*?)</table>', section, re.S).group(1)
    body = re.findall(r"<tr>(.*?)</tr>", cells.split("</thead>")[1], re.S)
    assert len(body) == len(POLICIES)
    assert "fetch_every_miss" in body[0]  # the baseline first, then by Δppl
    tests = pd.read_parquet(root / "analysis" / "tests.parquet").set_index("name")
    loop = tests.loc[row(table, "first_choice", "ends_in_loop")["test_name"], "p_adjusted"]
    assert f"+20 pt (sign p 0.12; adjusted {loop:.2g})" in cells
    assert "+7.20" in cells and "30%" in cells
    assert "continuation accuracy" not in html and "gsm8k accuracy" in html  # not graded
    lines = re.findall(r'<p class="outcome degeneration-line">(.*?)</p>', section, re.S)
    # every policy with mass > 0 repeats more (rep4, the longest span) at BH-adjusted p < 0.05;
    # a line per such policy, lowest Δppl first, quoting adjusted p, then the family's note
    flagged = [n for n in POLICIES if MASS[n] > 0]
    assert len(lines) == len(flagged) + 1
    assert lines[0].startswith("rule_tau0.08") and "substitute_all" in lines[-2]
    assert "Benjamini-Hochberg p = " in lines[0] and "(raw " in lines[0]
    family = int(tests["family_size"][tests["family"] == "exploratory"].iloc[0])
    assert lines[-1] == (
        f"p adjusted by Benjamini-Hochberg over the exploratory family ({family} tests), the "
        f"{3 * (len(POLICIES) - 1)} paired tests among them."
    )
    assert 'id="fig-degeneration"' in section and "data:image/png" in section
