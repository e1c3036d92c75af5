"""The skew-matched trace: target skew reached, every stream's routing kept exactly."""

from __future__ import annotations

import numpy as np
import pytest

from moesub.artefacts import topk_mask
from moesub.policy import STUDY_POLICIES, Policy, scan
from moesub.regime import lookahead_recall
from moesub.skew import effective_experts, target_shares, top_coverage
from moesub.skewmatch import match_counts, relabel_stream, skew_match
from moesub.synthetic import SyntheticRouting, synthetic_logits

S, T, L, E, K = 32, 128, 2, 64, 4


@pytest.fixture(scope="module")
def trace() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """32 streams of one synthetic run (shared popularity, topics, locality) and lookahead;
    skewed like the embedded model (a quarter of the experts cover ~0.8 of selections)."""
    z = synthetic_logits(S * T, L, E, seed=3, routing=SyntheticRouting(popularity_scale=1.2))
    y = synthetic_logits(S * T, L, E, seed=4) + z  # a lookahead correlated with the router
    return list(z.reshape(S, T, L, E)), list(y.reshape(S, T, L, E))


@pytest.fixture(scope="module")
def matched(trace):
    return skew_match(trace[0], K, target_shares(L, E), seed=0, lookahead=trace[1])


def _pooled(streams: list[np.ndarray]) -> np.ndarray:
    return sum(topk_mask(z, K).sum(axis=0) for z in streams)  # (L, E)


def _reuse_by_token(mask: np.ndarray) -> np.ndarray:
    """(T, E) top-k mask -> (T, k): per token the sorted distances to each selected expert's
    previous selection (-1: first selection)."""
    last = np.full(mask.shape[1], -1)
    out = []
    for t, row in enumerate(mask):
        ids = np.flatnonzero(row)
        out.append(np.sort(np.where(last[ids] >= 0, t - last[ids], -1)))
        last[ids] = t
    return np.array(out)


def test_pooled_skew_reaches_the_target(trace, matched):
    shares = target_shares(L, E)
    pooled = _pooled(matched.logits)
    np.testing.assert_array_equal(pooled, matched.counts)
    np.testing.assert_allclose(effective_experts(pooled), effective_experts(shares), rtol=0.02)
    np.testing.assert_allclose(top_coverage(pooled, 16), top_coverage(shares, 16), atol=0.01)
    # the synthetic trace starts elsewhere: the match moved it
    assert (top_coverage(_pooled(trace[0]), 16) > 0.74).all()
    # hot ids stay hot: each id's target is its original rank's share
    orig = _pooled(trace[0])
    for layer in range(L):
        hottest = np.argsort(-orig[layer], kind="stable")[:8]
        assert matched.target[layer, hottest] == pytest.approx(shares[layer, :8] * orig[0].sum())


def test_each_stream_is_its_own_routing_under_new_names(trace, matched):
    for s, (z, m) in enumerate(zip(trace[0], matched.logits, strict=True)):
        for layer in range(L):
            ids = matched.relabel[s, layer]
            assert sorted(ids.tolist()) == list(range(E))  # a permutation
            np.testing.assert_array_equal(m[:, layer, ids], z[:, layer])
            # same reuse: every token's selections at the same distances from their last use
            np.testing.assert_array_equal(
                _reuse_by_token(topk_mask(m[:, layer], K)),
                _reuse_by_token(topk_mask(z[:, layer], K)),
            )
        np.testing.assert_array_equal(np.sort(m, axis=-1), np.sort(z, axis=-1))
        np.testing.assert_array_equal(matched.stream_counts[s], topk_mask(z, K).sum(axis=0))
    # the lookahead moved with its layer's experts: the predictor's recall is unchanged
    for n in (K, 2 * K):
        before = lookahead_recall(trace[0], trace[1], K, n)
        after = lookahead_recall(matched.logits, matched.lookahead, K, n)
        np.testing.assert_array_equal(before[0], after[0])


def test_a_cache_relabelled_with_its_stream_replays_alike(trace, matched):
    # within a stream only the names change: the same cache under the same names decides the
    # same, up to the ties the policy breaks by id (LRU: the lower id among experts last used
    # at the same token, e.g. the initial residents), under a substituting policy
    policy = Policy.from_dict(STUDY_POLICIES["rule_015"])
    for s in (0, 5, 17):
        z, m, relabel = trace[0][s], matched.logits[s], matched.relabel[s]
        initial = np.tile(np.arange(16, dtype=np.int32), (L, 1))  # (L, C)
        moved = np.stack([relabel[layer, initial[layer]] for layer in range(L)]).astype(np.int32)
        a = scan(z, K, 16, policy, initial=initial)
        b = scan(m, K, 16, policy, initial=moved)
        assert (a.status == b.status).mean() > 0.98
        assert (b.status == 0).mean() == pytest.approx((a.status == 0).mean(), abs=0.01)
        assert b.mass.mean() == pytest.approx(a.mass.mean(), abs=0.005)


def test_seeded(trace, matched):
    again = skew_match(trace[0], K, target_shares(L, E), seed=0)
    np.testing.assert_array_equal(again.relabel, matched.relabel)
    other = skew_match(trace[0], K, target_shares(L, E), seed=1)
    assert not np.array_equal(other.relabel, matched.relabel)
    assert matched.lookahead is not None and again.lookahead is None


def test_match_counts_is_a_fixed_point_of_single_stream_moves():
    # no stream can swap two of its ids and bring the pooled counts closer to the target
    rng = np.random.default_rng(0)
    counts = rng.poisson(rng.gamma(0.5, 4.0, size=8), size=(6, 8))  # (S, E)
    target = np.sort(rng.dirichlet(np.ones(8)))[::-1] * counts.sum()
    relabel = match_counts(counts, target, np.random.default_rng(1))

    def error(r: np.ndarray) -> float:
        pooled = np.zeros(8)
        for row, c in zip(r, counts, strict=True):
            pooled[row] += c
        return float(((pooled - target) ** 2).sum())

    best = error(relabel)
    for s in range(6):
        for a in range(8):
            for b in range(a + 1, 8):
                r = relabel.copy()
                r[s, [a, b]] = r[s, [b, a]]
                assert error(r) >= best - 1e-9


def test_relabel_stream_by_hand():
    z = np.arange(6, dtype=np.float32).reshape(1, 2, 3)  # layer 0: [0 1 2], layer 1: [3 4 5]
    out = relabel_stream(z, np.array([[2, 0, 1], [0, 1, 2]]))
    np.testing.assert_array_equal(out[0], [[1, 2, 0], [3, 4, 5]])


def test_bad_input(trace):
    with pytest.raises(ValueError, match="shares: shape"):
        skew_match(trace[0], K, target_shares(L, 32))
    with pytest.raises(ValueError, match="sum to 1"):
        skew_match(trace[0], K, target_shares(L, E) * 2)
    with pytest.raises(ValueError, match="lookahead"):
        skew_match(trace[0], K, target_shares(L, E), lookahead=trace[1][:3])
    with pytest.raises(ValueError, match="at least one"):
        skew_match([], K, target_shares(L, E))
