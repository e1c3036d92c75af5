"""Policy semantics v3 (per-layer capacity, pin, host_admit): the C++ core against the
plain-Python reference for every field and combination, streaming = scan, every default v2 bit
for bit, the grid's token-layer counts, and bad input."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_cases import EXACT, FLOATS, assert_same, cases, run_both, tie_prone

from moesub.coactivation import coactivation
from moesub.grid import COUNTER_NAMES, GridPoint, replay, simulate
from moesub.policy import (
    HIT,
    HOST,
    TOKEN_LAYER_FIELDS,
    LayerCache,
    Policy,
    scan,
    token_layer_counts,
)
from moesub.policy_reference import reference_scan
from moesub.synthetic import synthetic_logits


@settings(max_examples=700, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(v3=True))
def test_scan_matches_reference(case):
    assert_same(*run_both(case))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(num_experts=st.sampled_from([32, 45, 70]), max_k=10, max_tokens=15, v3=True))
def test_scan_matches_reference_wide_rows(case):
    """E >= 32: the core's lane-filtered top-k."""
    assert_same(*run_both(case))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cases(online=True, max_tokens=30, v3=True),
    st.lists(st.integers(1, 9), min_size=1, max_size=4),
    st.booleans(),
)
def test_streaming_matches_whole_scan(case, chunks, external):
    """LayerCache per layer (its capacity, its pin, its initial set) in chunks = scan; with
    external admission the caller's admit() calls, made when the delay expires, land exactly
    scan's step-1 admissions (beta's and the host uploads alike)."""
    logits, k, capacity, policy, initial, A, y = case
    T, L, E = logits.shape
    whole = scan(logits, k, capacity, policy, initial, coactivation=A, lookahead=y)
    caps = (capacity,) * L if isinstance(capacity, int) else capacity
    for layer in range(L):
        init = None if initial is None else initial[layer]
        cache = LayerCache(
            E, k, caps[layer], policy.for_layer(layer), init, external_admission=external,
            coactivation=None if A is None else A[layer],
        )  # fmt: skip
        ready: list[tuple[int, int]] = []
        t, i = 0, 0
        while t < T:
            n = 1 if external else min(chunks[i % len(chunks)], T - t)
            landed = 0
            for _r, e in sorted(x for x in ready if x[0] <= t):
                landed += cache.admit(e)[1] >= 0  # an insertion evicts (the cache is full)
            ready = [x for x in ready if x[0] > t]
            rows = np.ascontiguousarray(logits[t : t + n, layer])
            ys = None if y is None else np.ascontiguousarray(y[t : t + n, layer])
            s = cache.step(rows, ys)
            if external:  # the engine's part: the copy completes when the delay expires
                ready += [(int(tt) + policy.delay, int(e)) for tt, e in s.admissions]
                assert s.admitted.tolist() == [0] and landed == whole.admitted[t, layer]
            else:
                np.testing.assert_array_equal(s.admitted, whole.admitted[t : t + n, layer])
            sl = (slice(t, t + n), layer)
            for f in ("ids", "status", "selected", "weights", "mass", "rerouted", "prefetched"):
                np.testing.assert_array_equal(getattr(s, f), getattr(whole, f)[sl], err_msg=f)
            np.testing.assert_array_equal(s.requested, whole.requested[sl])
            requests_at = np.bincount(s.admissions[:, 0] - t, minlength=n)
            np.testing.assert_array_equal(requests_at, s.requested)
            if not external:
                np.testing.assert_array_equal(
                    token_layer_counts(s), token_layer_counts(whole)[t : t + n, layer]
                )
            t, i = t + n, i + 1
        c = cache.counters()
        assert c["admission_requests"] == whole.requested[:, layer].sum()
        assert c["admissions"] == whole.admitted[:, layer].sum()


# ---------------------------------------------------------------------------------------------
# every default reproduces v2 bit for bit

# The study's and v2's policies on a fixed trace (its float16-rounded copy too: ties), each from
# the default and a shuffled initial set. The digests were taken with the v2 core (commit
# f3f05d7, before v3) by the same computation with v2's API.
V2_POLICIES = {
    "fetch_every_miss": dict(),
    "substitute_all": dict(rule="substitute_all"),
    "rule_015": dict(rule="threshold", tau=0.15),
    "quality": dict(rule="threshold", tau=0.15, eviction="lfu", beta=0.5),
    "speed": dict(rule="first_choice", eviction="lfu", beta=0.5),
    "host_compute": dict(rule="host_compute"),
    "delayed": dict(rule="threshold", tau=0.3, beta=0.2, delay=3),
    "belady": dict(eviction="belady"),
    "belady_admit": dict(rule="first_choice", eviction="belady", beta=0.3, prefetch=2),
    "prefetch": dict(rule="threshold", tau=0.15, prefetch=3, eviction="lfu", beta=0.3),
    "bias": dict(rule="first_choice", route_bias=0.05),
    "hybrid": dict(rule="threshold", tau=0.15, light_miss="host", prefetch=2),
    "buddy": dict(rule="substitute_all", substitute_by="coactivation", beta=0.4),
    "all_v2": dict(rule="threshold", tau=0.2, eviction="lfu", beta=0.3, prefetch=2,
                   route_bias=0.1, substitute_by="coactivation"),
}  # fmt: skip
V2_SCAN_DIGEST = "8a20cb5887d1ea66809ca18d6578544541d6a267269ff039ba0ba3eefed169f9"
V2_GRID_DIGEST = "05759c0b0e7c53a9760c2613b46fb2cbb8ae4fff63be46978917badf31d3fc71"
V2_FIELDS = ("ids", "weights", "status", "selected", "mass", "rerouted", "prefetched")
GRID_COLUMNS = (*COUNTER_NAMES[:-1], "prefetches", "mass_mean", "mass_p50", "mass_p90",
                "mass_p99", "rerouted_mean", "belady_hit_rate")  # fmt: skip


@pytest.fixture(scope="module")
def fixed_trace():
    k, C = 6, 16
    x = synthetic_logits(240, 3, 64, seed=7)
    ties = x.astype(np.float16).astype(np.float32)
    rng = np.random.default_rng(8)
    y = (x + 2.0 * rng.standard_normal(x.shape)).astype(np.float32)
    A = coactivation(synthetic_logits(100, 3, 64, seed=9), k)
    initial = np.stack([rng.permutation(64)[:C] for _ in range(3)]).astype(np.int32)
    return k, C, x, ties, y, A, initial


def test_v2_policies_reproduce_the_v2_core_bit_for_bit(fixed_trace):
    k, C, x, ties, y, A, initial = fixed_trace
    h = hashlib.sha256()
    for trace in (x, ties):
        for kw in V2_POLICIES.values():
            for init in (None, initial):
                r = scan(trace, k, C, Policy(**kw), init, coactivation=A, lookahead=y)
                for f in V2_FIELDS:
                    h.update(np.ascontiguousarray(getattr(r, f)).tobytes())
    assert h.hexdigest() == V2_SCAN_DIGEST
    grid = [GridPoint(n, Policy(**kw), C, initial, C / 64) for n, kw in V2_POLICIES.items()]
    df = simulate([x[:100], ties[100:]], k, grid, lookahead=[y[:100], y[100:]], coactivation=A,
                  n_threads=2)  # fmt: skip
    g = hashlib.sha256()
    for c in GRID_COLUMNS:
        g.update(df[c].fill_null(-1.0).cast(float).to_numpy().astype(np.float64).tobytes())
    assert g.hexdigest() == V2_GRID_DIGEST


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(v3=True))
def test_neutral_v3_spellings_are_v2(case):
    """pin 0 (an int or a tuple of zeros), host_admit 0, a capacity tuple of one value and the
    initial set as a list give the v2 call's outputs bit for bit."""
    logits, k, capacity, policy, initial, A, y = case
    L = logits.shape[1]
    if not isinstance(capacity, int) and len(set(capacity)) > 1:
        return  # v2 has one capacity
    C = capacity if isinstance(capacity, int) else capacity[0]
    v2 = Policy(**{**policy.to_dict(), "pin": 0, "host_admit": 0})
    array = None if initial is None else np.stack([np.asarray(r) for r in initial])
    base = scan(logits, k, C, v2, array, coactivation=A, lookahead=y)
    for spelled in (
        scan(logits, k, (C,) * L, Policy(**{**v2.to_dict(), "pin": (0,) * L}),
             None if array is None else list(array), coactivation=A, lookahead=y),
        scan(logits, k, [C] * L, v2, array, coactivation=A, lookahead=y),
    ):  # fmt: skip
        for f in EXACT + FLOATS:
            np.testing.assert_array_equal(getattr(spelled, f), getattr(base, f), err_msg=f)


# ---------------------------------------------------------------------------------------------
# what each field does


def test_pinned_experts_are_never_evicted():
    """The first `pin` experts of each layer's initial set stay resident: every selection of
    one is a hit, under every eviction, and they serve as substitutes like any resident."""
    rng = np.random.default_rng(0)
    x = tie_prone(rng, (300, 2, 40), 1.0)
    initial = [rng.permutation(40)[:12], rng.permutation(40)[:10]]
    pin = (5, 3)
    for ev in ("lru", "lfu", "belady"):
        for rule in ("fetch_all", "first_choice"):
            r = scan(x, 4, (12, 10), Policy(rule=rule, eviction=ev, pin=pin, beta=0.2), initial)
            for layer in range(2):
                pinned = np.isin(r.selected[:, layer], initial[layer][: pin[layer]])
                assert pinned.any() and (r.status[:, layer][pinned] == HIT).all()
    # as substitutes: substitute_all never changes the cache, so its pinned residents stand in
    r = scan(x, 4, 12, Policy(rule="substitute_all", pin=8), initial[0][None].repeat(2, 0))
    assert np.isin(r.ids, initial[0][:8]).any()


def test_static_set_with_a_small_pool():
    """pin = C - k with LRU: the static keep-set plus a k-slot pool; only the pool's experts
    are ever evicted, so at most k distinct non-pinned experts are resident."""
    rng = np.random.default_rng(1)
    x = tie_prone(rng, (200, 1, 32), 1.0)
    k, C = 3, 10
    cache = LayerCache(32, k, C, Policy(rule="first_choice", pin=C - k))
    pinned = list(range(C - k))
    for t in range(200):
        cache.step(np.ascontiguousarray(x[t : t + 1, 0]))
        assert cache.resident()[: C - k].tolist() == pinned


def test_host_uploads_land_after_the_delay():
    """host_compute + lru + host_admit (llama.cpp PR #27861): a HOST expert is computed on the
    host now and, uploaded in the background, resident `delay` tokens later; at most host_admit
    uploads per token-layer, in rank order; nothing is ever substituted (lossless)."""
    E, k, C = 16, 2, 4
    z = np.full((4, 1, E), -5.0, np.float32)
    for t, sel in enumerate([(8, 9), (10, 11), (8, 9), (8, 9)]):
        z[t, 0, list(sel)] = [5.0, 4.0]
    for delay in (1, 2):
        r = scan(z, k, C, Policy(rule="host_compute", host_admit=1, delay=delay))
        assert r.status[:, 0].tolist()[:2] == [[HOST, HOST], [HOST, HOST]]
        # uploads of 8, 10, then 9 (8 is a hit at token 2); at token 3, 9 is pending or resident
        assert r.requested[:, 0].tolist() == [1, 1, 1, 0]
        assert r.admitted[:, 0].tolist() == ([0, 1, 1, 1] if delay == 1 else [0, 0, 1, 1])
        assert r.status[2, 0].tolist() == [HIT, HOST]
        assert r.status[3, 0].tolist() == ([HIT, HIT] if delay == 1 else [HIT, HOST])
        np.testing.assert_array_equal(r.ids, r.selected)  # computed exactly
    two = scan(z, k, C, Policy(rule="host_compute", host_admit=2))
    assert two.requested[:, 0].tolist() == [2, 2, 0, 0] and (two.status[2:] == HIT).all()
    # host_admit = 0 is v2's host_compute: the cache never changes
    plain = scan(z, k, C, Policy(rule="host_compute"))
    assert (plain.status == HOST).all() and not plain.requested.any()


def test_host_uploads_of_light_misses_and_pending_experts():
    """light_miss='host' uploads only the misses computed on the host (not the fetched first
    choice); an expert whose upload is pending is not requested again."""
    E, k, C = 16, 3, 5
    z = np.full((3, 1, E), -5.0, np.float32)
    for t in range(3):
        z[t, 0, [10 + t, 8, 9]] = [6.0, 5.0, 4.0]
    p = Policy(rule="first_choice", light_miss="host", host_admit=3, delay=3)
    r = scan(z, k, C, p)
    assert r.status[0, 0].tolist() == [1, HOST, HOST]  # FETCH, then the light misses on the host
    assert r.requested[:, 0].tolist() == [2, 0, 0]  # 8 and 9 pending until token 3
    assert_same(r, reference_scan(z, k, C, p))


def test_per_layer_capacities():
    """Each layer is its own cache: a layer scanned with capacity C_l equals that layer alone."""
    x = tie_prone(np.random.default_rng(2), (150, 3, 48), 1.0)
    caps, p = (8, 16, 30), Policy(rule="threshold", tau=0.2, eviction="lfu", beta=0.3)
    r = scan(x, 6, caps, p)
    for layer, C in enumerate(caps):
        alone = scan(np.ascontiguousarray(x[:, layer : layer + 1]), 6, C, p)
        for f in EXACT + FLOATS:
            np.testing.assert_array_equal(getattr(r, f)[:, layer], getattr(alone, f)[:, 0])
    hits = [(r.status[:, layer] == HIT).mean() for layer in range(3)]
    assert hits[0] < hits[1] < hits[2]


# ---------------------------------------------------------------------------------------------
# the grid: per-layer caches, and each token-layer's counts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_tokens=20, v3=True), st.integers(1, 3))
def test_grid_token_counts_equal_scans(case, n_streams):
    """The grid's token-layer counts are `token_layer_counts` of each stream's scan, streams in
    order; they sum to the grid's counters."""
    logits, k, capacity, policy, initial, A, y = case
    cut = np.linspace(0, logits.shape[0], n_streams + 1).astype(int)
    streams = [logits[a:b] for a, b in zip(cut[:-1], cut[1:], strict=True) if b > a]
    ys = None if y is None else [y[a:b] for a, b in zip(cut[:-1], cut[1:], strict=True) if b > a]
    grid = [GridPoint("p", policy, capacity, initial), GridPoint("fem", Policy(), capacity)]
    rep = replay(streams, k, grid, lookahead=ys, coactivation=A, token_counts=True, n_threads=2)
    for gi, g in enumerate(grid):
        per_stream = rep.stream_counts(gi)
        for s, ls, got in zip(streams, ys or [None] * len(streams), per_stream, strict=True):
            r = scan(s, k, capacity, g.policy, g.initial, coactivation=A, lookahead=ls)
            np.testing.assert_array_equal(got, token_layer_counts(r))
        sums = rep.token_counts[gi].sum(0, dtype=np.int64)  # (L, F)
        c = {name: rep.counters[gi, :, i] for i, name in enumerate(COUNTER_NAMES)}
        for f, name in enumerate(TOKEN_LAYER_FIELDS):
            want = c["prefetches"] if name == "prefetched" else c[name]
            np.testing.assert_array_equal(sums[:, f], want, err_msg=name)


def test_grid_table_with_per_layer_capacities():
    x = synthetic_logits(200, 3, 64, seed=3)
    caps, init = (8, 16, 24), [np.arange(64)[::-1][:C] for C in (8, 16, 24)]
    grid = [
        GridPoint("uneven", Policy(pin=(2, 4, 6)), caps, init, fraction=0.25),
        GridPoint("mean_not_integral", Policy(), (8, 16, 25)),
    ]
    df = simulate([x], 4, grid).sort("policy", "layer")
    uneven = df.filter(df["policy"] == "uneven")
    assert uneven["capacity"].to_list() == [16, *caps] and (uneven["fraction"] == 0.25).all()
    other = df.filter(df["policy"] == "mean_not_integral")
    assert other["capacity"].to_list() == [None, 8, 16, 25]
    assert other["fraction"][0] == pytest.approx(49 / (3 * 64))
    r = scan(x, 4, caps, Policy(pin=(2, 4, 6)), init)
    assert uneven.filter(uneven["layer"] == -1)["hit"][0] == (r.status == HIT).sum()


# ---------------------------------------------------------------------------------------------
# bad input: clear errors, naming the layer, before any work


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pin=-1), "policy pin: must be an integer >= 0, got -1"),
        (dict(pin=(1, -2)), "policy pin: must be an integer >= 0, got -2"),
        (dict(pin=1.5), "policy pin: must be an integer"),
        (dict(pin=[]), "policy pin: a per-layer pin needs one integer per MoE layer"),
        (dict(host_admit=-1), "policy host_admit: must be an integer >= 0"),
        (dict(host_admit=2), "policy host_admit: uploads host-computed misses"),
        (dict(rule="threshold", tau=0.1, host_admit=1), "policy host_admit"),
    ],
)
def test_bad_v3_policy(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Policy(**kwargs)


def test_v3_policy_forms():
    p = Policy(pin=[1, 2], rule="host_compute", host_admit=2)
    assert p.pin == (1, 2) and p.for_layer(1).pin == 2 and p.layer_pins(2) == (1, 2)
    assert Policy(pin=3).for_layer(7).pin == 3 and Policy(pin=3).layer_pins(2) == (3, 3)
    assert Policy.from_dict(p.to_dict()) == p
    assert Policy(rule="first_choice", light_miss="host", host_admit=1).host_admit == 1
    with pytest.raises(ValueError, match="policy pin: no value for layer 2"):
        p.for_layer(2)
    with pytest.raises(ValueError, match="policy pin: 2 per-layer values for 3 MoE layers"):
        p.layer_pins(3)


def test_bad_v3_arrays():
    x = np.zeros((4, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"capacity: C=2 in layer 1 is smaller than k=3"):
        scan(x, 3, (4, 2, 4), Policy())
    with pytest.raises(ValueError, match=r"capacity: C=9 in layer 2 exceeds .* E=8"):
        scan(x, 3, (4, 4, 9), Policy())
    with pytest.raises(ValueError, match="capacity: 2 per-layer capacities for 3 layers"):
        scan(x, 3, (4, 4), Policy())
    with pytest.raises(ValueError, match="policy pin: 2 per-layer values for 3 MoE layers"):
        scan(x, 3, 4, Policy(pin=(1, 1)))
    with pytest.raises(ValueError, match=r"policy pin: pin=2 \+ max\(k=3, prefetch=0\) exceeds "
                       r"the capacity C=4 in layer 1"):  # fmt: skip
        scan(x, 3, (6, 4, 6), Policy(pin=2))
    with pytest.raises(ValueError, match=r"pin=1 \+ max\(k=1, prefetch=4\) .* in layer 0"):
        scan(x, 1, 4, Policy(pin=1, prefetch=4), lookahead=x)
    with pytest.raises(ValueError, match="initial: 2 per-layer sets for 3 layers"):
        scan(x, 3, 4, Policy(), [np.arange(4)] * 2)
    with pytest.raises(ValueError, match=r"initial: expected shape \(5,\) \(layer 1\)"):
        scan(x, 3, (4, 5, 4), Policy(), [np.arange(4)] * 3)
    with pytest.raises(ValueError, match=r"duplicate expert ids in the resident set \(layer 2\)"):
        scan(x, 3, 4, Policy(), [np.arange(4), np.arange(4), np.array([0, 1, 1, 2])])
    with pytest.raises(ValueError, match=r"per-layer capacities \(4, 5, 4\) need a sequence"):
        scan(x, 3, (4, 5, 4), Policy(), np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError, match="policy pin: a per-layer pin; take the layer's policy"):
        LayerCache(8, 3, 4, Policy(pin=(1, 1, 1)))
    with pytest.raises(ValueError, match=r"policy pin: pin=2 \+ max\(k=3, prefetch=0\)"):
        LayerCache(8, 3, 4, Policy(pin=2))
    with pytest.raises(ValueError, match="grid point 'p': policy pin: pin=2"):
        simulate([x], 3, [GridPoint("p", Policy(pin=(0, 2, 0)), 4)])
    with pytest.raises(ValueError, match="token counts: replay"):
        replay([x], 3, [GridPoint("p", Policy(), 4)]).stream_counts(0)
