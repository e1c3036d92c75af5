"""moesub.stats.intervals and moesub.stats.power: the stream bootstrap (BCa / basic, bias)
against brute-force loops, and the power helpers against hand-computed values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures_artefacts import make_study
from scipy import stats as sps

from moesub.stats import (
    bootstrap_interval,
    correlation,
    level_label,
    paired_mde,
    proportion_mde,
    run_analysis,
    stream_bootstrap,
    wilcoxon_min_p,
    z_of,
)
from moesub.stats.intervals import boot_indices, rng_for, weighted_pearson


def bca_by_hand(est: float, boot: list[float], jack: list[float], level: float):
    """Efron's BCa, written out scalar by scalar (basic interval where z0 is infinite)."""
    boot = sorted(boot)
    tol = 1e-9 * max(abs(est), max(abs(b) for b in boot))  # equal up to rounding: a tie
    below = sum(1.0 for b in boot if b < est - tol) + 0.5 * sum(
        1.0 for b in boot if abs(b - est) <= tol
    )
    share = below / len(boot)
    alpha = (1 - level) / 2
    if share in (0.0, 1.0):
        q_lo, q_hi = np.quantile(boot, [alpha, 1 - alpha])
        return 2 * est - q_hi, 2 * est - q_lo, "basic"
    z0 = sps.norm.ppf(share)
    jbar = sum(jack) / len(jack)
    num = sum((jbar - j) ** 3 for j in jack)
    den = 6 * sum((jbar - j) ** 2 for j in jack) ** 1.5
    a = num / den
    levels = []
    for z in (sps.norm.ppf(alpha), sps.norm.ppf(1 - alpha)):
        levels.append(sps.norm.cdf(z0 + (z0 + z) / (1 - a * (z0 + z))))
    lo, hi = np.quantile(boot, levels)
    return lo, hi, "bca"


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """The synthetic study with policy x stream noise (per-token noise scaled by each policy's
    mass, so every (policy, stream) mean ΔNLL moves differently)."""
    root = tmp_path_factory.mktemp("noisy")
    inputs, params = make_study(
        root / "results", n_streams=7, noise=2.0, names=["fetch_every_miss", "rule_015"]
    )
    params = {**params, "n_boot": 300, "ci_level": 0.9}
    doc = run_analysis(inputs, params, root / "an")
    return inputs, params, doc, pd.read_parquet(root / "an" / "summary.parquet")


def test_dppl_bootstrap_matches_brute_force_loop(noisy):
    """Δppl of rule_015: resample streams with the analysis' own draws, recompute Δppl from the
    raw tokens in a Python loop, then BCa by hand; CI, bias and method must match."""
    inputs, params, _, summary = noisy
    emu = {
        p.split("/")[-2]: pd.read_parquet(p).set_index(["stream", "pos"]) for p in inputs["emulate"]
    }
    d = (emu["rule_015"]["nll"] - emu["fetch_every_miss"]["nll"]).dropna()
    by_stream = {s: g.to_numpy() for s, g in d.groupby(level="stream")}
    streams = sorted(by_stream)

    def dppl(sample: list[int]) -> float:
        return 100 * math.expm1(np.concatenate([by_stream[streams[i]] for i in sample]).mean())

    n = len(streams)
    est = dppl(list(range(n)))
    idx = boot_indices(n, params["n_boot"], rng_for(0, "quality", "dppl", "rule_015", 0.25))
    boot = [dppl(list(row)) for row in idx]
    jack = [dppl([j for j in range(n) if j != i]) for i in range(n)]
    lo, hi, method = bca_by_hand(est, boot, jack, params["ci_level"])
    row = summary.set_index("policy").loc["rule_015"]
    assert row["dppl_pct"] == pytest.approx(est, rel=1e-10)
    assert row["dppl_ci_method"] == method == "bca"
    assert (row["dppl_ci_lo"], row["dppl_ci_hi"]) == pytest.approx((lo, hi), rel=1e-9)
    assert row["dppl_bias"] == pytest.approx(np.mean(boot) - est, rel=1e-9, abs=1e-12)
    assert row["dppl_ci_lo"] < est < row["dppl_ci_hi"]


def test_stream_bootstrap_vector_statistic_matches_loop():
    """A (R, P) statistic: every column gets its own interval from the same resamples."""
    rng = np.random.default_rng(3)
    sums = rng.normal(size=(9, 3)) + np.arange(3)  # (S, P) per-stream sums
    cnts = rng.integers(5, 20, size=(9, 3)).astype(float)

    def stat(w):
        return (w @ sums) / (w @ cnts)

    ivs = stream_bootstrap(stat, 9, 200, rng_for(1, "x"), 0.95)
    idx = boot_indices(9, 200, rng_for(1, "x"))
    for p, iv in enumerate(ivs):
        boot = [sums[row, p].sum() / cnts[row, p].sum() for row in idx]
        jack = [np.delete(sums[:, p], i).sum() / np.delete(cnts[:, p], i).sum() for i in range(9)]
        est = sums[:, p].sum() / cnts[:, p].sum()
        lo, hi, method = bca_by_hand(est, boot, jack, 0.95)
        assert (iv.ci_lo, iv.ci_hi, iv.method) == (pytest.approx(lo), pytest.approx(hi), method)
        assert iv.bias == pytest.approx(np.mean(boot) - est)


def test_bca_agrees_with_scipy_on_a_mean():
    """Same formula as scipy.stats.bootstrap(method='BCa') up to resampling noise."""
    x = np.random.default_rng(0).exponential(size=40)
    (iv,) = stream_bootstrap(lambda w: (w @ x) / w.sum(1), 40, 20000, rng_for(0, "m"), 0.95)
    ref = sps.bootstrap((x,), np.mean, n_resamples=20000, method="BCa", random_state=1)
    assert iv.ci_lo == pytest.approx(ref.confidence_interval.low, abs=0.03)
    assert iv.ci_hi == pytest.approx(ref.confidence_interval.high, abs=0.03)
    assert iv.method == "bca"


def test_basic_interval_where_bca_is_undefined_and_none_when_mostly_nan():
    # every resample above the estimate: z0 infinite -> basic, reflected around the estimate
    iv = bootstrap_interval(1.0, np.array([2.0, 3.0, 4.0, 5.0]), np.array([1.0, 2.0]), 0.5)
    q_lo, q_hi = np.quantile([2.0, 3.0, 4.0, 5.0], [0.25, 0.75])
    assert iv.method == "basic" and (iv.ci_lo, iv.ci_hi) == (2 - q_hi, 2 - q_lo)
    assert iv.bias == pytest.approx(2.5)
    iv = bootstrap_interval(1.0, np.array([np.nan, np.nan, 1.0]), np.ones(3), 0.9)
    assert iv.method == "none" and iv.ci_lo is None and iv.n_valid == 1


def test_ci_level_everywhere():
    assert z_of(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert z_of(0.8) == pytest.approx(1.281552, abs=1e-6)
    assert level_label(0.95) == "95%" and level_label(0.9) == "90%"
    x = np.arange(10.0)
    y = x + np.random.default_rng(2).normal(size=10)
    wide, narrow = correlation(x, y, 0.99), correlation(x, y, 0.8)
    assert wide["r_ci_lo"] < narrow["r_ci_lo"] < narrow["r"] < narrow["r_ci_hi"] < wide["r_ci_hi"]
    half = math.atanh(narrow["r_ci_hi"]) - math.atanh(narrow["r"])
    assert half == pytest.approx(z_of(0.8) / math.sqrt(10 - 3))
    bare = correlation(x, y, parametric=False)
    assert bare["r"] == pytest.approx(narrow["r"]) and "p" not in bare and "r_ci_lo" not in bare


def test_noisy_study_reports_intervals_at_its_level(noisy):
    _, _, doc, summary = noisy
    assert doc["ci_label"] == "90%"
    row = summary.set_index("policy").loc["rule_015"]
    assert row["mass_ci_lo"] <= row["mass_per_token_layer"] <= row["mass_ci_hi"]


def test_wilcoxon_floor():
    assert wilcoxon_min_p(4) == 1 / 16
    # scipy's exact test at n = 4 with every difference positive reaches exactly that floor
    assert sps.wilcoxon([0.1, 0.2, 0.3, 0.4], alternative="greater").pvalue == 1 / 16
    assert wilcoxon_min_p(4, "two-sided") == 1 / 8
    assert wilcoxon_min_p(24) == 2**-24 and wilcoxon_min_p(0) == 1.0


def test_minimum_detectable_effects():
    # (z_0.95 + z_0.8) * sd / sqrt(n) = (1.6449 + 0.8416) * 1 / 5
    assert paired_mde(1.0, 25, 0.05) == pytest.approx(0.497295, abs=1e-6)
    assert paired_mde(1.0, 1, 0.05) is None
    # two-sided 5%, 80% power, p0 = 0.5, n = 100: 1.96 * 0.05 + 0.8416 * sqrt(p1 q1 / 100) = d
    assert proportion_mde(0.5, 100, 0.05) == pytest.approx(0.138434, abs=1e-5)
    assert proportion_mde(0.0, 100, 0.05) is None  # nothing to drop from
    assert proportion_mde(0.05, 10, 0.05) is None  # even 0% is not far enough with 10 problems


def test_t_interval_of_a_mean_is_the_classic_one():
    """For a mean, the jackknife SE is s / sqrt(n): the sensitivity interval is Student's."""
    x = np.random.default_rng(4).normal(1.0, 2.0, 24)
    (iv,) = stream_bootstrap(lambda w: (w @ x) / w.sum(1), 24, 200, rng_for(0, "t"), 0.95)
    lo, hi = sps.t.interval(0.95, 23, loc=x.mean(), scale=sps.sem(x))
    assert (iv.t_lo, iv.t_hi) == (pytest.approx(lo, rel=1e-12), pytest.approx(hi, rel=1e-12))
    assert iv.se == pytest.approx(sps.sem(x), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bootstrap_p_value_inverts_its_interval(seed):
    """p of "mean = 0": the interval at level 1 - p has 0 on its edge, so a slightly wider
    interval holds 0 and a slightly narrower one does not."""
    x = np.random.default_rng(seed).exponential(size=20) - 0.75

    def stat(w):
        return (w @ x) / w.sum(1)

    (iv,) = stream_bootstrap(stat, 20, 4000, rng_for(seed, "p"), 0.95, null=0.0)
    p = iv.p_value
    assert 2 / 4000 < p < 0.9, p
    wide = stream_bootstrap(stat, 20, 4000, rng_for(seed, "p"), 1 - 0.9 * p)[0]
    narrow = stream_bootstrap(stat, 20, 4000, rng_for(seed, "p"), 1 - 1.1 * p)[0]
    assert wide.ci_lo < 0 < wide.ci_hi
    assert not narrow.ci_lo < 0 < narrow.ci_hi
    # with no resample beyond the null, p is the floor 1 / B
    (far,) = stream_bootstrap(stat, 20, 400, rng_for(seed, "p"), 0.95, null=-10.0)
    assert far.p_value == pytest.approx(1 / 400)


def test_weighted_pearson_is_pearson_of_the_repeated_points():
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=9), rng.normal(size=9)
    counts = rng.integers(0, 4, size=(5, 9)).astype(float)
    counts[:, :3] += 1  # at least three distinct points per row
    got = weighted_pearson(x, y, counts)
    for row, r in zip(counts.astype(int), got, strict=True):
        want = sps.pearsonr(np.repeat(x, row), np.repeat(y, row))[0]
        assert r == pytest.approx(want, abs=1e-12)
    assert np.isnan(weighted_pearson(np.ones(9), y, counts)).all()  # constant mass


def test_document_correlation_resamples_streams_with_their_documents(noisy):
    """Per-document r of rule_015: its interval is the BCa of r over stream resamples (every
    document of a drawn stream comes along), by a Python loop over the analysis' own draws."""
    inputs, params, doc, _ = noisy
    root = Path(inputs["emulate"][0]).parents[4]  # results/tiny/emulate/<policy>/f.parquet
    pts = pd.read_parquet(root / "an" / "per_input_points.parquet")
    pts = pts[(pts["policy"] == "rule_015") & (pts["level"] == "document")]
    by_stream = {s: g for s, g in pts.groupby("stream")}
    streams = sorted(by_stream)

    def r_of(sample):
        g = pd.concat([by_stream[streams[i]] for i in sample])
        return sps.pearsonr(g["mass_per_token_layer"], g["dnll_mean"])[0]

    n = len(streams)
    idx = boot_indices(n, params["n_boot"], rng_for(0, "per_input", "rule_015", 0.25))
    boot = [r_of(row) for row in idx]
    jack = [r_of([j for j in range(n) if j != i]) for i in range(n)]
    est = r_of(range(n))
    lo, hi, method = bca_by_hand(est, boot, jack, params["ci_level"])
    row = pd.read_parquet(root / "an" / "per_input.parquet").set_index(["policy", "level"])
    row = row.loc[("rule_015", "document")]
    assert row["r"] == pytest.approx(est, abs=1e-9)
    assert (row["r_ci_lo"], row["r_ci_hi"]) == (
        pytest.approx(lo, abs=1e-9),
        pytest.approx(hi, abs=1e-9),
    )
    assert row["ci_method"] == f"stream-clustered bootstrap, {method}"
    assert pd.isna(row["rho_p"])  # no Spearman p over documents that are not independent
