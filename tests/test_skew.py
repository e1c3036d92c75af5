"""Skew measures against hand-computed shares, the real model's figures, the share curves."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from moesub.regime import skew_table
from moesub.skew import (
    REAL_EFFECTIVE_EXPERTS,
    REAL_TOP_COVERAGE,
    ShareCurve,
    effective_experts,
    fit_share_curve,
    real_band,
    real_figures,
    target_shares,
    top_coverage,
)


def test_effective_experts_known_values():
    assert effective_experts(np.ones(64)) == pytest.approx(64)
    assert effective_experts(np.r_[5, np.zeros(63)]) == pytest.approx(1)
    assert effective_experts(np.array([[3, 3, 0, 0], [1, 1, 1, 1]])) == pytest.approx([2, 4])
    # shares 1/2, 1/4, 1/4: entropy 1.5 ln 2, exp -> 2^1.5
    assert effective_experts(np.array([2, 1, 1])) == pytest.approx(2**1.5)
    with pytest.raises(ValueError, match="at least one selection"):
        effective_experts(np.zeros(4))


def test_top_coverage_by_hand():
    counts = np.array([1, 5, 0, 3, 1])  # 10 selections, hottest 5 then 3
    assert top_coverage(counts, 1) == pytest.approx(0.5)
    assert top_coverage(counts, 2) == pytest.approx(0.8)
    assert top_coverage(counts, 5) == pytest.approx(1.0)
    rows = np.array([[4, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(top_coverage(rows, 2), [1.0, 0.5])
    with pytest.raises(ValueError, match="capacity"):
        top_coverage(counts, 6)
    with pytest.raises(ValueError, match="at least one selection"):
        top_coverage(np.zeros((2, 3)), 1)


def test_real_figures_are_the_published_ranges():
    # ../shared/notes/runtimes-and-hardware.md: 289-427 effective experts (median 329), top-128
    # coverage 0.44-0.65 (median 0.60), 48 layers
    eff, cov = np.array(REAL_EFFECTIVE_EXPERTS), np.array(REAL_TOP_COVERAGE)
    assert len(eff) == len(cov) == 48
    assert (round(eff.min()), round(eff.max()), round(float(np.median(eff)))) == (289, 427, 329)
    assert (round(cov.min(), 2), round(cov.max(), 2), round(float(np.median(cov)), 2)) == (
        0.44,
        0.65,
        0.60,
    )


def test_real_bands_split_the_48_layers_by_depth():
    assert [list(real_band(j, 4)) for j in range(4)] == [
        list(range(12 * j, 12 * j + 12)) for j in range(4)
    ]
    assert list(real_band(0, 1)) == list(range(48))
    assert [len(real_band(j, 64)) for j in range(64)] == [1] * 64
    assert real_band(63, 64) == range(47, 48)
    with pytest.raises(ValueError, match="layer"):
        real_band(4, 4)
    figs = real_figures(2)
    assert figs[0, 0] == pytest.approx(np.mean(REAL_EFFECTIVE_EXPERTS[:24]))
    assert figs[1, 1] == pytest.approx(np.mean(REAL_TOP_COVERAGE[24:]))


def test_share_curve_is_a_cut_lognormal_in_rank_quantiles():
    s = ShareCurve(sigma=1.0, tau=-20.0).shares(4)  # no cut: exp(z_r), r = 0..3
    z = np.array([1.1503494, 0.3186394, -0.3186394, -1.1503494])  # Φ⁻¹(7/8, 5/8, 3/8, 1/8)
    np.testing.assert_allclose(s, np.exp(z) / np.exp(z).sum(), rtol=1e-6)
    cut = ShareCurve(sigma=1.0, tau=0.0).shares(4)  # experts below the median get nothing
    assert cut[2] == cut[3] == 0 and cut[0] > cut[1] > 0
    with pytest.raises(ValueError, match="no expert"):
        ShareCurve(sigma=1.0, tau=5.0).shares(4)


@pytest.mark.parametrize("layer", [0, 9, 24, 47])
def test_fit_reaches_each_real_layers_figures(layer):
    eff, cov = REAL_EFFECTIVE_EXPERTS[layer], REAL_TOP_COVERAGE[layer]
    s = fit_share_curve(eff, cov).shares(512)
    assert effective_experts(s) == pytest.approx(eff, rel=5e-3)
    assert top_coverage(s, 128) == pytest.approx(cov, rel=5e-3)


def test_fit_rejects_figures_no_curve_has():
    with pytest.raises(ValueError, match="no share curve"):
        fit_share_curve(600, 0.5)
    with pytest.raises(ValueError, match="no share curve"):
        fit_share_curve(500, 0.95)  # nearly uniform use cannot put 95% on a quarter


def test_target_shares_carry_the_band_figures_and_scale_with_E():
    shares = target_shares(4, 512)
    assert shares.shape == (4, 512)
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    assert (np.diff(shares, axis=1) <= 0).all()  # hottest first
    figs = real_figures(4)
    np.testing.assert_allclose(effective_experts(shares), figs[:, 0], rtol=5e-3)
    np.testing.assert_allclose(top_coverage(shares, 128), figs[:, 1], rtol=5e-3)
    # in rank quantiles: at E = 64 the same share of experts is effective, a quarter covers
    # about as much
    small = target_shares(4, 64)
    np.testing.assert_allclose(effective_experts(small) / 64, figs[:, 0] / 512, rtol=0.06)
    np.testing.assert_allclose(top_coverage(small, 16), figs[:, 1], rtol=0.03)


def test_skew_table_by_hand():
    # one layer, E = 8 (study C = 2): counts 4 3 1 1 1 0 0 0 (10 selections)
    counts = np.array([[4, 3, 1, 1, 1, 0, 0, 0]])
    matched = np.array([[2, 2, 2, 1, 1, 1, 1, 0]])
    shares = np.array([[0.25, 0.25, 0.125, 0.125, 0.125, 0.125, 0.0, 0.0]])
    # two streams: 4 3 0 ... (7 selections, top 2 cover 1) and 0 0 1 1 1 (3, top 2 cover 2/3)
    streams = np.array([[[4, 3, 0, 0, 0, 0, 0, 0]], [[0, 0, 1, 1, 1, 0, 0, 0]]])
    table = skew_table(
        counts, matched, streams, shares, np.array([[1, 2]]), np.array([[0, 7]]),
        np.array([0.6, 0.6]), {"f0.5": 4},
    )  # fmt: skip
    row = table.filter(pl.col("layer") == 0).row(0, named=True)
    assert row["top_coverage"] == pytest.approx(0.7)
    assert row["real_top_coverage"] == pytest.approx(0.5)
    assert row["matched_top_coverage"] == pytest.approx(0.4)
    assert row["top_coverage_f0.5"] == pytest.approx(0.9)
    assert row["real_top_coverage_f0.5"] == pytest.approx(0.75)
    # shares 1/4 1/4 1/8 x 4: entropy = 2 (1/4 ln 4) + 4 (1/8 ln 8) = ln 2 + 1.5 ln 2
    assert row["real_effective_experts"] == pytest.approx(2**2.5)
    assert row["initial_coverage"] == pytest.approx(0.4)  # experts 1 and 2: 3 + 1 of 10
    assert row["matched_initial_coverage"] == pytest.approx(0.2)
    assert row["matched_hit_rate"] == pytest.approx(0.6)
    assert row["stream_top_coverage"] == pytest.approx((7 * 1 + 3 * 2 / 3) / 10)
    assert table["layer"].to_list() == [0, -1]


def test_skew_table_pools_layers():
    counts = np.array([[5, 5, 0, 0], [4, 2, 1, 1]])
    table = skew_table(
        counts, counts, counts[None], np.full((2, 4), 0.25), np.array([[0], [0]]),
        np.array([[1], [1]]), np.array([0.5, 0.7, 0.6]), {},
    )  # fmt: skip
    total = table.filter(pl.col("layer") == -1).row(0, named=True)
    assert total["top_coverage"] == pytest.approx((0.5 + 0.5) / 2)  # C = 1 at E = 4
    assert total["initial_coverage"] == pytest.approx((0.5 + 0.5) / 2)
    assert total["matched_initial_coverage"] == pytest.approx((0.5 + 0.25) / 2)
    assert total["matched_effective_experts"] == pytest.approx(2.0)  # the smaller layer's
    assert total["matched_hit_rate"] == pytest.approx(0.6)
