"""Policy semantics v2 (prefetch, route_bias, light_miss, substitute_by, belady eviction): what
each field does, v1 reproduced by every default, and bad input. The core against the
plain-Python reference for every field and combination: tests/test_policy_v3.py."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_cases import assert_same, cases, run_both, tie_prone

from moesub.coactivation import coactivation
from moesub.grid import GridPoint, simulate
from moesub.policy import FETCH, HIT, HOST, SUB, LayerCache, Policy, scan


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cases(num_experts=st.sampled_from([6, 12, 40]), max_k=6, max_tokens=12),
    st.sampled_from([1e-3, 1e6, 1e12, 1e17, 1e30]),
    st.integers(0, 2**31 - 1),
)
def test_route_bias_where_rounding_merges_biased_logits(case, lam, seed):
    """A bias that is huge against the logits' spacing rounds distinct z + b to one float64:
    the tie rule (lower id) then decides S, in the core's fast and slow paths alike."""
    logits, k, C, policy, initial, A, y = case
    rng = np.random.default_rng(seed)
    palette = np.array([0.0, -0.0, 1e-38, -1e-38, 1e-7, 3e-7, 1.0, 1.0000001, 2.5, -4.0])
    logits = palette[rng.integers(0, len(palette), logits.shape)].astype(np.float32)
    biased = Policy(**{**policy.to_dict(), "eviction": "lru", "route_bias": lam})
    assert_same(*run_both((logits, k, C, biased, initial, A, y)))


# ---------------------------------------------------------------------------------------------
# every default reproduces v1 bit for bit, and each field's neutral setting too


@settings(max_examples=100, deadline=None)
@given(cases())
def test_neutral_v2_settings_are_v1_bit_for_bit(case):
    logits, k, C, policy, initial, _, y = case
    T, L, E = logits.shape
    v1 = Policy(policy.rule, policy.tau, "lru", 0.0 if policy.light_miss == "host" else policy.beta)
    base = scan(logits, k, C, v1, initial)
    fields = ("ids", "weights", "status", "selected", "mass", "rerouted", "prefetched")

    def same(r):
        for f in fields:
            np.testing.assert_array_equal(getattr(r, f), getattr(base, f), err_msg=f)

    # v2 defaults, spelled out, with unused arrays passed along
    explicit = Policy(v1.rule, v1.tau, v1.eviction, v1.beta, prefetch=0, route_bias=0.0,
                      light_miss="substitute", substitute_by="logit")  # fmt: skip
    same(scan(logits, k, C, explicit, initial, coactivation=np.zeros((L, E, E)), lookahead=y))
    # a table with one value: every tie goes to the higher logit, then the lower id = "logit"
    flat = Policy(v1.rule, v1.tau, v1.eviction, v1.beta, substitute_by="coactivation")
    same(scan(logits, k, C, flat, initial, coactivation=np.full((L, E, E), 0.25)))
    # everything resident: the bias lifts every logit alike, so S and its weights are v1's
    everything = Policy(v1.rule, v1.tau, route_bias=0.7)
    a = scan(logits, k, E, everything)
    b = scan(logits, k, E, Policy(v1.rule, v1.tau))
    for f in fields:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert (a.rerouted == 0).all()


# ---------------------------------------------------------------------------------------------
# what each field does


def test_prefetch_of_the_exact_top_k_makes_every_selection_a_hit():
    """P = the top-k itself: after step 1b all of P is resident (P is pinned while it is
    inserted), so even substitute_all never misses, and each token inserts only new experts."""
    rng = np.random.default_rng(0)
    x = tie_prone(rng, (200, 2, 40), 1.0)
    k = 6
    for ev in ("lru", "lfu", "belady"):
        r = scan(x, k, k, Policy(rule="substitute_all", eviction=ev, prefetch=k), lookahead=x)
        assert (r.status == HIT).all()
        new = [len(set(r.selected[t, 0]) - set(r.selected[t - 1, 0])) for t in range(1, 200)]
        np.testing.assert_array_equal(r.prefetched[1:, 0], new)


def test_prefetch_is_not_a_use():
    """A prefetched expert keeps its freq and last use: at token 2 the fetch of 5 evicts 3
    (prefetched at token 1, never used), not 1 (used at tokens 0 and 1)."""
    E, k, C = 8, 1, 2
    z = np.full((3, 1, E), -5.0, np.float32)
    y = np.full((3, 1, E), -5.0, np.float32)
    for t, (sel, pre) in enumerate([(1, 1), (1, 3), (5, 1)]):
        z[t, 0, sel] = 5.0
        y[t, 0, pre] = 5.0
    for ev in ("lru", "lfu"):
        r = scan(z, k, C, Policy(eviction=ev, prefetch=1), lookahead=y)
        assert r.prefetched[:, 0].tolist() == [0, 1, 0]  # token 1: 3 replaces 0 (never used)
        assert r.status[:, 0, 0].tolist() == [HIT, HIT, FETCH]
        cache = LayerCache(E, k, C, Policy(eviction=ev, prefetch=1))
        cache.step(np.ascontiguousarray(z[:, 0]), np.ascontiguousarray(y[:, 0]))
        assert sorted(cache.resident().tolist()) == [1, 5]


def test_route_bias_keeps_selections_resident():
    """A large bias: with C >= k every selection is resident, so nothing misses; the original
    top-k's mass moved off is the rerouted mass, and the weights stay a softmax of the
    original logits over S."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2, 64)).astype(np.float32)
    r = scan(x, 8, 16, Policy(rule="substitute_all", route_bias=10.0))
    assert (r.status == HIT).all()
    assert r.rerouted.max() > 0.5 and (r.mass == 0).all()
    top = np.take_along_axis(x.astype(np.float64), r.selected.astype(np.int64), -1)
    e = np.exp(top - top.max(-1, keepdims=True))
    np.testing.assert_allclose(r.weights, e / e.sum(-1, keepdims=True), rtol=1e-14, atol=1e-300)
    small = scan(x, 8, 16, Policy(rule="substitute_all", route_bias=0.05))
    plain = scan(x, 8, 16, Policy(rule="substitute_all"))
    assert (small.status == HIT).mean() > (plain.status == HIT).mean()
    assert 0 < small.rerouted.mean() < r.rerouted.mean()


def test_light_misses_on_the_host_are_lossless():
    x = np.random.default_rng(2).normal(size=(300, 2, 64)).astype(np.float32)
    sub = scan(x, 8, 16, Policy(rule="threshold", tau=0.15))
    host = scan(x, 8, 16, Policy(rule="threshold", tau=0.15, light_miss="host"))
    assert (host.mass == 0).all() and not (host.status == SUB).any()
    np.testing.assert_array_equal(host.selected, sub.selected)  # same routing
    assert (host.status == HOST).any()
    # computed exactly: every slot computes its own selected expert
    np.testing.assert_array_equal(host.ids, host.selected)


def test_coactivation_substitute_is_the_most_coselected_resident():
    """substitute_all never changes the cache (experts 0..C-1), so each token's first
    substitute is drawn from the residents outside its selection: the one most co-selected
    with the miss (ties: higher logit, then lower id)."""
    x = np.random.default_rng(3).normal(size=(400, 1, 32)).astype(np.float32)
    A = coactivation(x[:200], 4)
    z = x[200:, 0]
    r = scan(x[200:], 4, 8, Policy(rule="substitute_all", substitute_by="coactivation"),
             coactivation=A)  # fmt: skip
    checked = 0
    for t in range(200):
        subs = np.flatnonzero(r.status[t, 0] == SUB)
        if not len(subs):
            continue
        miss = r.selected[t, 0, subs[0]]
        cands = [c for c in range(8) if c not in r.selected[t, 0]]
        best = min(cands, key=lambda c: (-A[0, miss, c], -z[t, c], c))
        assert r.ids[t, 0, subs[0]] == best
        checked += 1
    assert checked > 100


def test_belady_eviction_of_fetch_all_is_the_v1_bound():
    """eviction='belady' with fetch_all has exactly the hits of the simulator's v1 bound."""
    x = tie_prone(np.random.default_rng(4), (300, 3, 64), 1.0)
    rng = np.random.default_rng(5)
    initial = np.stack([rng.permutation(64)[:16] for _ in range(3)]).astype(np.int32)
    r = scan(x, 4, 16, Policy(eviction="belady"), initial)
    df = simulate([x], 4, [GridPoint("f", Policy(), 16, initial)])
    for row in df.filter(pl.col("layer") >= 0).to_dicts():
        assert (r.status[:, row["layer"]] == HIT).sum() == round(row["belady_hit_rate"] * 300 * 4)
    lru = scan(x, 4, 16, Policy(), initial)
    assert (r.status == HIT).sum() > (lru.status == HIT).sum()


# ---------------------------------------------------------------------------------------------
# the co-activation table and the simulator


def reference_coactivation(streams: list[np.ndarray], k: int) -> np.ndarray:
    L, E = streams[0].shape[1:]
    both = np.zeros((L, E, E))
    for x in streams:
        for t in range(x.shape[0]):
            for layer in range(L):
                S = sorted(range(E), key=lambda e: (-float(x[t, layer, e]), e))[:k]
                for a in S:
                    for c in S:
                        both[layer, a, c] += 1
    n = np.diagonal(both, axis1=1, axis2=2)
    return both / np.maximum(1, n)[:, :, None]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([5, 16, 40]), st.integers(1, 5))
def test_coactivation_matches_reference(seed, E, k):
    rng = np.random.default_rng(seed)
    streams = [tie_prone(rng, (T, 2, E), 0.5) for T in (7, 12)]
    A = coactivation(streams, k)
    np.testing.assert_array_equal(A, reference_coactivation(streams, k))
    np.testing.assert_array_equal(
        coactivation(streams[0], k), reference_coactivation(streams[:1], k)
    )
    assert A.dtype == np.float64 and A.shape == (2, E, E)


def test_simulator_counts_v2_policies_like_scan():
    rng = np.random.default_rng(6)
    x = tie_prone(rng, (250, 3, 48), 1.0)
    y = (x + tie_prone(rng, x.shape, 0.7)).astype(np.float32)
    streams, ys = [x[:100], x[100:]], [y[:100], y[100:]]
    A = coactivation(tie_prone(rng, (100, 3, 48), 1.0), 4)
    policies = {
        "prefetch": Policy(rule="threshold", tau=0.15, prefetch=4, eviction="lfu", beta=0.3),
        "bias": Policy(rule="first_choice", route_bias=0.05),
        "both": Policy(rule="threshold", tau=0.15, prefetch=4, route_bias=0.05),
        "hybrid": Policy(rule="threshold", tau=0.15, light_miss="host"),
        "buddy": Policy(rule="substitute_all", substitute_by="coactivation"),
        "belady": Policy(rule="first_choice", eviction="belady", prefetch=2),
    }
    grid = [GridPoint(n, p, 12) for n, p in policies.items()]
    df = simulate(streams, 4, grid, lookahead=ys, coactivation=A, n_threads=2)
    for name, p in policies.items():
        rs = [
            scan(s, 4, 12, p, coactivation=A, lookahead=ly)
            for s, ly in zip(streams, ys, strict=True)
        ]
        status = np.concatenate([r.status for r in rs])
        tot = df.filter((pl.col("policy") == name) & (pl.col("layer") == -1)).row(0, named=True)
        for code, col in ((HIT, "hit"), (FETCH, "fetch"), (SUB, "sub"), (HOST, "host")):
            assert tot[col] == (status == code).sum(), (name, col)
        assert tot["prefetches"] == sum(r.prefetched.sum() for r in rs)
        rerouted = np.concatenate([r.rerouted for r in rs])
        assert tot["rerouted_mean"] == pytest.approx(rerouted.mean(), abs=1e-12)
        mass = np.concatenate([r.mass for r in rs])
        assert tot["mass_mean"] == pytest.approx(mass.mean(), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# bad input: clear errors before any work


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(route_bias=-0.1), "policy route_bias: must be a finite number >= 0"),
        (dict(route_bias=float("nan")), "policy route_bias"),
        (dict(prefetch=-1), "policy prefetch: must be an integer >= 0, got -1"),
        (dict(prefetch=1.5), "policy prefetch: must be an integer"),
        (dict(prefetch=True), "policy prefetch: must be an integer"),
        (dict(light_miss="cpu"), "policy light_miss: unknown value 'cpu'"),
        (dict(substitute_by="buddy"), "policy substitute_by: unknown value 'buddy'"),
        (dict(eviction="belady", route_bias=0.1), "policy eviction: 'belady' needs the future"),
        (dict(eviction="optimal"), "policy eviction: unknown value 'optimal'"),
        (dict(light_miss="host", rule="threshold", tau=0.1, beta=0.5), "policy beta: with light"),
    ],
)
def test_bad_v2_policy(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Policy(**kwargs)


def test_bad_v2_arrays():
    x = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match="policy prefetch: n=5 exceeds the capacity C=4"):
        scan(x, 2, 4, Policy(prefetch=5), lookahead=x)
    with pytest.raises(ValueError, match="lookahead: policy prefetch > 0 needs"):
        scan(x, 2, 4, Policy(prefetch=2))
    with pytest.raises(ValueError, match="lookahead: expected the logits' shape"):
        scan(x, 2, 4, Policy(prefetch=2), lookahead=x[:3])
    with pytest.raises(ValueError, match="lookahead: expected a float32"):
        scan(x, 2, 4, Policy(prefetch=2), lookahead=x.astype(np.float64))
    bad = x.copy()
    bad[2, 1, 5] = np.nan
    with pytest.raises(ValueError, match=r"lookahead: contain NaN or inf.*\(2, 1, 5\)"):
        scan(x, 2, 4, Policy(prefetch=2), lookahead=bad)
    buddy = Policy(rule="substitute_all", substitute_by="coactivation")
    with pytest.raises(ValueError, match="coactivation: substitute_by='coactivation' needs"):
        scan(x, 2, 4, buddy)
    with pytest.raises(ValueError, match=r"coactivation: expected shape \(2, 8, 8\)"):
        scan(x, 2, 4, buddy, coactivation=np.zeros((8, 8)))
    with pytest.raises(ValueError, match="coactivation: expected finite"):
        scan(x, 2, 4, buddy, coactivation=np.full((2, 8, 8), np.nan))
    with pytest.raises(ValueError, match="streaming LayerCache"):
        LayerCache(8, 2, 4, Policy(eviction="belady"))
    with pytest.raises(ValueError, match="policy prefetch: n=5 exceeds the capacity C=4"):
        LayerCache(8, 2, 4, Policy(prefetch=5))
    with pytest.raises(ValueError, match=r"coactivation: expected shape \(8, 8\)"):
        LayerCache(8, 2, 4, buddy, coactivation=np.zeros((2, 8, 8)))
    with pytest.raises(ValueError, match="lookahead: policy prefetch > 0 needs"):
        LayerCache(8, 2, 4, Policy(prefetch=1)).step(x[:, 0].copy())
    with pytest.raises(ValueError, match="lookahead: need one array per stream"):
        simulate([x], 2, [GridPoint("p", Policy(prefetch=1), 4)], lookahead=[x, x])
    with pytest.raises(ValueError, match="lookahead: policy prefetch > 0 needs"):
        simulate([x], 2, [GridPoint("p", Policy(prefetch=1), 4)])
    with pytest.raises(ValueError, match="coactivation: need at least one"):
        coactivation([], 2)
    with pytest.raises(ValueError, match=r"logits: contain NaN or inf.*\(2, 1, 5\)"):
        coactivation(bad, 2)
    with pytest.raises(ValueError, match="k: must be in"):
        coactivation(x, 9)
