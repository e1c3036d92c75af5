"""The C++ policy core against the plain-Python reference, and its error handling."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moesub.policy import (
    EVICTIONS,
    FETCH,
    FORCED,
    HIT,
    HOST,
    RULES,
    SUB,
    LayerCache,
    Policy,
    forced_substitution,
    scan,
)
from moesub.policy_reference import reference_scan

SMALL_E = st.integers(2, 20)


@st.composite
def cases(draw, num_experts=SMALL_E, max_k=6, max_tokens=40):
    E = draw(num_experts)
    k = draw(st.integers(1, min(E, max_k)))
    C = draw(st.integers(k, E))
    T = draw(st.integers(1, max_tokens))
    L = draw(st.integers(1, 3))
    rule = draw(st.sampled_from(RULES))
    beta = 0.0 if rule == "host_compute" else draw(st.sampled_from([0.0, 0.05, 0.3, 0.5, 1.0]))
    policy = Policy(
        rule=rule,
        tau=draw(st.sampled_from([0.1, 0.15, 0.3, 0.9] + ([] if rule == "threshold" else [0.0]))),
        eviction=draw(st.sampled_from(EVICTIONS)),
        beta=beta,
        delay=draw(st.integers(1, 4)),
    )
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    # float16 rounding and a small range make exact logit ties common
    scale = draw(st.sampled_from([0.3, 1.0, 4.0]))
    logits = (rng.normal(size=(T, L, E)) * scale).astype(np.float16).astype(np.float32)
    initial = None
    if draw(st.booleans()):
        initial = np.stack([rng.permutation(E)[:C] for _ in range(L)]).astype(np.int32)
    return logits, k, C, policy, initial


def assert_same(a, b):
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.status, b.status)
    np.testing.assert_array_equal(a.selected, b.selected)
    np.testing.assert_allclose(a.weights, b.weights, rtol=0, atol=1e-12)
    np.testing.assert_allclose(a.mass, b.mass, rtol=0, atol=1e-12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_scan_matches_reference(case):
    logits, k, C, policy, initial = case
    assert_same(scan(logits, k, C, policy, initial), reference_scan(logits, k, C, policy, initial))


# E >= 32 takes the core's lane-filtered top-k; E not a multiple of 32 leaves a ragged tail
wide_cases = cases(num_experts=st.sampled_from([32, 45, 64, 70, 100]), max_k=12, max_tokens=25)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wide_cases)
def test_scan_matches_reference_wide_rows(case):
    logits, k, C, policy, initial = case
    assert_same(scan(logits, k, C, policy, initial), reference_scan(logits, k, C, policy, initial))


@settings(max_examples=150, deadline=None)
@given(st.one_of(cases(), wide_cases), st.lists(st.integers(1, 15), min_size=1, max_size=6))
def test_streaming_matches_whole_scan(case, chunks):
    logits, k, C, policy, initial = case
    T, L, E = logits.shape
    whole = scan(logits, k, C, policy, initial)
    for layer in range(L):
        cache = LayerCache(E, k, C, policy, None if initial is None else initial[layer])
        t, i = 0, 0
        while t < T:
            n = min(chunks[i % len(chunks)], T - t)
            s = cache.step(np.ascontiguousarray(logits[t : t + n, layer]))
            np.testing.assert_array_equal(s.ids, whole.ids[t : t + n, layer])
            np.testing.assert_array_equal(s.status, whole.status[t : t + n, layer])
            np.testing.assert_array_equal(s.mass, whole.mass[t : t + n, layer])
            # the slot holds the computed expert right after the token (HOST has no slot)
            if n == 1:
                res = cache.resident()
                comp = s.status[0] != HOST
                np.testing.assert_array_equal(res[s.slot[0][comp]], s.ids[0][comp])
                assert (s.slot[0][~comp] == -1).all()
            t, i = t + n, i + 1
        assert cache.t == T


@settings(max_examples=150, deadline=None)
@given(cases())
def test_external_admission_equals_delay(case):
    """Calling admit() exactly when the delay expires reproduces the internal queue."""
    logits, k, C, policy, initial = case
    T, L, E = logits.shape
    whole = scan(logits, k, C, policy, initial)
    for layer in range(L):
        init = None if initial is None else initial[layer]
        cache = LayerCache(E, k, C, policy, init, external_admission=True)
        ready: list[tuple[int, int]] = []
        for t in range(T):
            for _r, e in sorted(x for x in ready if x[0] <= t):
                slot, _ = cache.admit(e)
                assert cache.resident()[slot] == e
            ready = [x for x in ready if x[0] > t]
            s = cache.step(np.ascontiguousarray(logits[t : t + 1, layer]))
            ready += [(int(tt) + policy.delay, int(e)) for tt, e in s.admissions]
            np.testing.assert_array_equal(s.ids[0], whole.ids[t, layer])
            np.testing.assert_array_equal(s.status[0], whole.status[t, layer])


def belady_reference(sel: np.ndarray, C: int, initial: list[int]) -> int:
    resident, hits = list(initial), 0
    for t, S in enumerate(sel.tolist()):
        for e in S:
            if e in resident:
                hits += 1
                continue

            def next_use(x, t=t):
                return next((u for u in range(t + 1, len(sel)) if x in sel[u]), 10**9)

            victim = max((x for x in resident if x not in S), key=lambda x: (next_use(x), -x))
            resident[resident.index(victim)] = e
    return hits


@settings(max_examples=80, deadline=None)
@given(cases())
def test_belady_is_optimal_floor(case):
    from moesub.grid import GridPoint, simulate

    logits, k, C, _, _ = case
    T, L, E = logits.shape
    grid = [GridPoint(ev, Policy(eviction=ev), C) for ev in EVICTIONS]
    df = simulate([logits], k, grid).to_dicts()
    for row in df:
        if row["layer"] < 0 or row["capacity"] != C:
            continue
        assert row["belady_hit_rate"] >= row["hit_rate"] - 1e-12
        sel = reference_scan(logits, k, C, Policy()).selected[:, row["layer"]]
        assert row["belady_hit_rate"] * T * k == pytest.approx(
            belady_reference(sel, C, list(range(C)))
        )


def test_named_policies_order_on_synthetic_trace():
    """The miss rules substitute in the expected order on a Qwen3-Next-shaped trace."""
    from moesub.synthetic import synthetic_logits

    x = synthetic_logits(400, 2, 512, seed=1)
    sub = {
        name: (scan(x, 10, 128, p).status == SUB).mean()
        for name, p in {
            "fetch_every_miss": Policy(),
            "rule_015": Policy(rule="threshold", tau=0.15),
            "first_choice": Policy(rule="first_choice"),
            "substitute_all": Policy(rule="substitute_all"),
        }.items()
    }
    assert sub["fetch_every_miss"] == 0
    assert 0 < sub["rule_015"] < sub["first_choice"] < sub["substitute_all"]
    hc = scan(x, 10, 128, Policy(rule="host_compute"))
    assert set(np.unique(hc.status)) <= {HIT, HOST} and (hc.mass == 0).all()


def test_first_choice_never_substituted_and_weights_normalized():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 2, 32)).astype(np.float32)
    r = scan(x, 4, 8, Policy(rule="first_choice", eviction="lfu", beta=0.3))
    assert not (r.status[:, :, 0] == SUB).any()
    np.testing.assert_allclose(r.weights.sum(-1), 1.0, atol=1e-12)
    assert (np.diff(r.weights, axis=-1) <= 0).all()  # rank order
    assert not (r.status == FORCED).any()  # with a full cache and k <= C a candidate always exists
    assert ((r.status == FETCH) | (r.status == HIT) | (r.status == SUB)).all()


@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0, 800.0])
def test_gate_weights_are_a_float64_softmax(spread):
    """The core's own vectorized exp: weights within a few ulp of NumPy's softmax of the top-k,
    down to gaps where e^x is subnormal or rounds to zero (spread 800)."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(300, 1, 64)) * spread).astype(np.float32)
    r = scan(x, 16, 16, Policy())
    top = np.take_along_axis(x[:, 0].astype(np.float64), r.selected[:, 0].astype(np.int64), 1)
    e = np.exp(top - top[:, :1])
    softmax = e / e.sum(1, keepdims=True)
    np.testing.assert_allclose(r.weights[:, 0], softmax, rtol=2e-15, atol=1e-300)


def test_forced_substitution_picks_core_substitutes():
    rng = np.random.default_rng(3)
    T, E, k = 50, 16, 4
    x = rng.normal(size=(T, E)).astype(np.float32)
    resident = np.arange(0, 16, 2, dtype=np.int32)
    mask = np.zeros((T, k), bool)
    mask[:, 2] = True
    ids, w, sel = forced_substitution(x, k, resident, mask)
    for t in range(T):
        selected = {int(e) for e in sel[t]}  # a substituted expert never stands in for itself
        cand = [e for e in resident.tolist() if e not in selected]
        best = min(cand, key=lambda e: (-x[t, e], e))
        assert ids[t, 2] == best
        np.testing.assert_array_equal(np.delete(ids[t], 2), np.delete(sel[t], 2))
    np.testing.assert_allclose(w.sum(1), 1, atol=1e-12)


def test_scan_releases_the_gil():
    x = np.random.default_rng(0).normal(size=(3000, 8, 512)).astype(np.float32)
    done = threading.Event()

    def work():
        scan(x, 10, 128, Policy(rule="threshold", tau=0.15, eviction="lfu", beta=0.5))
        done.set()

    th = threading.Thread(target=work)
    th.start()
    ticks = 0
    while not done.is_set():
        ticks += 1
    th.join()
    # with the GIL held for the whole scan this loop could not run while it did
    assert ticks > 1000


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rule="nope"), "policy rule"),
        (dict(eviction="fifo"), "policy eviction"),
        (dict(tau=-0.1), "policy tau"),
        (dict(beta=-1.0), "policy beta"),
        (dict(beta=float("nan")), "policy beta"),
        (dict(delay=0), "policy delay"),
        (dict(delay=1.5), "policy delay"),
        (dict(rule="host_compute", beta=0.5), "policy beta"),
        # the config's rules are Policy's: the library accepts nothing the config rejects
        (dict(rule="threshold"), "policy tau: rule 'threshold' needs tau > 0"),
        (dict(tau=True), "policy tau: must be a finite number"),
        (dict(delay=1.0), "policy delay: must be an integer >= 1, got 1.0"),
        (dict(delay=True), "policy delay"),
        (dict(tau="0.1"), "policy tau"),
    ],
)
def test_bad_policy(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Policy(**kwargs)


def test_policy_stores_numbers_as_float_and_counts_as_int():
    p = Policy(rule="threshold", tau=1, beta=np.float32(0.5), delay=np.int64(2), prefetch=3)
    assert [type(v) for v in (p.tau, p.beta, p.route_bias, p.delay, p.prefetch)] == [
        float, float, float, int, int
    ]  # fmt: skip
    assert p == Policy(rule="threshold", tau=1.0, beta=0.5, delay=2, prefetch=3)


def test_policy_from_dict_unknown_key():
    with pytest.raises(ValueError, match="unknown key"):
        Policy.from_dict({"rule": "fetch_all", "taux": 0.1})


def test_bad_scan_arguments():
    x = np.zeros((4, 2, 8), np.float32)
    p = Policy()
    with pytest.raises(ValueError, match="logits: dtype"):
        scan(x.astype(np.float64), 2, 4, p)
    with pytest.raises(ValueError, match="logits: expected 3"):
        scan(x[0], 2, 4, p)
    with pytest.raises(ValueError, match="numpy array"):
        scan(x.tolist(), 2, 4, p)
    bad = x.copy()
    bad[1, 1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or inf.*\\(1, 1, 3\\)"):
        scan(bad, 2, 4, p)
    bad[1, 1, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        scan(bad, 2, 4, p)
    with pytest.raises(ValueError, match="capacity: C=1 is smaller than k=2"):
        scan(x, 2, 1, p)
    with pytest.raises(ValueError, match="capacity: C=9 exceeds"):
        scan(x, 2, 9, p)
    with pytest.raises(ValueError, match="^k:"):
        scan(x, 0, 4, p)
    with pytest.raises(ValueError, match="policy: expected"):
        scan(x, 2, 4, {"rule": "fetch_all"})
    with pytest.raises(ValueError, match="initial: expected shape"):
        scan(x, 2, 4, p, initial=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="initial: duplicate.*layer 1"):
        scan(x, 2, 4, p, initial=np.array([[0, 1, 2, 3], [0, 1, 1, 3]]))
    with pytest.raises(ValueError, match="initial: expert ids must be in"):
        scan(x, 2, 4, p, initial=np.array([[0, 1, 2, 8], [0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="initial: expected integer"):
        scan(x, 2, 4, p, initial=np.zeros((2, 4)))


def test_bad_layer_cache_arguments():
    p = Policy(beta=0.5, rule="substitute_all")
    with pytest.raises(ValueError, match="capacity"):
        LayerCache(8, 4, 2, p)
    cache = LayerCache(8, 2, 4, p)
    with pytest.raises(ValueError, match="expected 8 experts"):
        cache.step(np.zeros((3, 9), np.float32))
    with pytest.raises(ValueError, match="external_admission"):
        cache.admit(5)
    ext = LayerCache(8, 2, 4, p, external_admission=True)
    with pytest.raises(ValueError, match="no pending admission"):
        ext.admit(5)


@settings(max_examples=120, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([16, 20, 31, 32, 33, 63, 160, 512, 1000, 4096, 5000]),
    st.sampled_from([1, 3, 4, 5, 8, 10, 16, 32, 33]),
    st.sampled_from(["normal", "duplicated", "constant"]),
)
def test_topk_fast_path_matches_lexsort(seed, E, k, kind):
    """Up to E = 4096 the lane-filtered fast path runs: 16 lanes for k <= 4 (E >= 16), 32 lanes
    for k <= 32 (E >= 32); check every path against a full sort: exact ties, a ragged tail, rows
    with one value."""
    k = min(k, E)
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(40, 1, E)) * 0.5).astype(np.float16).astype(np.float32)
    if kind == "duplicated":  # exact duplicates across lanes and within them
        x[:, 0, : E // 2] = x[:, 0, E // 2 : 2 * (E // 2)]
        x[:, 0, ::32] = x[:, 0, :1]
    elif kind == "constant":
        x[:] = x[:, :, :1]
    got = scan(x, k, k, Policy()).selected[:, 0]
    order = np.lexsort((np.arange(E)[None].repeat(40, 0), -x[:, 0]), axis=1)[:, :k]
    np.testing.assert_array_equal(got, order)


@pytest.mark.parametrize("E, k", [(8, 2), (20, 2), (64, 2), (70, 2), (64, 10), (70, 10)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("route_bias", [0.0, 0.1])  # route_bias: the pass also takes the row min
def test_non_finite_logits_found_in_every_top_k_path(E, k, bad, route_bias):
    """The core's own check (scan skips a separate NumPy pass): small rows, 16 and 32 lanes,
    ragged tails."""
    x = np.random.default_rng(0).normal(size=(5, 3, E)).astype(np.float32)
    for where in [(0, 0, 0), (3, 2, E - 1), (4, 1, E // 2)]:
        y = x.copy()
        y[where] = bad
        with pytest.raises(ValueError, match="NaN or inf.*" + re.escape(str(where))):
            scan(y, k, min(12, E), Policy(route_bias=route_bias))


def test_study_policies_match_the_shipped_config():
    """STUDY_POLICIES (what code uses without a config) and config.yaml name the same policies."""
    from pathlib import Path

    import yaml

    from moesub.config import normalize_policy
    from moesub.policy import STUDY_POLICIES

    config = yaml.safe_load((Path(__file__).parents[1] / "config.yaml").read_text())
    for name, spec in STUDY_POLICIES.items():
        assert name in config["policies"], name
        assert normalize_policy(name, spec) == normalize_policy(name, config["policies"][name])
