"""The hypothesis cases of the policy core's differential tests (tests/test_policy_v2.py,
tests/test_policy_v3.py): every v2 field and combination, and with `v3` per-layer capacities,
pins and host uploads; and the comparison of a scan with `reference_scan`."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from moesub.coactivation import coactivation
from moesub.policy import (
    EVICTIONS,
    LIGHT_MISSES,
    OFFLINE_EVICTIONS,
    RULES,
    SUBSTITUTE_BY,
    Policy,
    scan,
)
from moesub.policy_reference import reference_scan

EXACT = ("ids", "status", "selected", "prefetched", "requested", "admitted")
FLOATS = ("weights", "mass", "rerouted")


def tie_prone(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """float16 rounding and a small range make exact ties common."""
    return (rng.normal(size=shape) * scale).astype(np.float16).astype(np.float32)


@st.composite
def policies(draw, capacities: list[int], k: int, online: bool = False, v3: bool = False):
    """A policy for layers of these capacities: v2's fields, and with `v3` a pin (an int or one
    per layer, pin_l + max(k, prefetch) <= C_l) and host_admit (where misses run on the host)."""
    rule = draw(st.sampled_from(RULES))
    light_miss = draw(st.sampled_from(LIGHT_MISSES))
    on_host = rule == "host_compute" or light_miss == "host"
    evictions = EVICTIONS if online else EVICTIONS + OFFLINE_EVICTIONS
    eviction = draw(st.sampled_from(evictions))
    route_bias = 0.0 if eviction == "belady" else draw(st.sampled_from([0.0, 0.02, 0.1, 0.5, 3.0]))
    C = min(capacities)
    prefetch = draw(st.one_of(st.integers(0, min(C, 3)), st.just(C)))
    pin, host_admit = 0, 0
    if v3:
        room = [c - max(k, prefetch) for c in capacities]  # the most each layer can pin
        if draw(st.booleans()):
            pin = draw(st.integers(0, min(room)))
        else:
            pin = tuple(draw(st.integers(0, r)) for r in room)
        host_admit = draw(st.integers(0, 3)) if on_host else 0
    return Policy(
        rule=rule,
        tau=draw(st.sampled_from([0.15, 0.3, 0.9] + ([] if rule == "threshold" else [0.0]))),
        eviction=eviction,
        beta=0.0 if on_host else draw(st.sampled_from([0.0, 0.05, 0.3, 1.0])),
        delay=draw(st.integers(1, 3)),
        prefetch=prefetch,
        route_bias=route_bias,
        light_miss=light_miss,
        substitute_by=draw(st.sampled_from(SUBSTITUTE_BY)),
        pin=pin,
        host_admit=host_admit,
    )


SMALL_E = st.integers(2, 16)


@st.composite
def cases(draw, num_experts=SMALL_E, max_k=5, max_tokens=25, online=False, v3=False):
    """(logits, k, capacity, policy, initial, coactivation table, lookahead). v2: one capacity
    C and initial None or (L, C). With `v3`: L up to 3, capacity an int or a tuple (equal or
    not), initial None, an (L, C) array (equal capacities) or a list of L arrays."""
    E = draw(num_experts)
    k = draw(st.integers(1, min(E, max_k)))
    T = draw(st.integers(1, max_tokens))
    L = draw(st.integers(1, 3 if v3 else 2))
    uniform = not v3 or draw(st.booleans())
    caps = [draw(st.integers(k, E))] * L if uniform else [draw(st.integers(k, E)) for _ in range(L)]
    policy = draw(policies(caps, k, online, v3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    logits = tie_prone(rng, (T, L, E), draw(st.sampled_from([0.3, 1.0, 4.0])))
    initial = None
    form = draw(st.sampled_from(["none", "array", "list"] if v3 else ["none", "array"]))
    if form == "array" and uniform:
        initial = np.stack([rng.permutation(E)[: caps[0]] for _ in range(L)]).astype(np.int32)
    elif form != "none":
        initial = [rng.permutation(E)[:C] for C in caps]
    capacity = caps[0] if uniform and (not v3 or draw(st.booleans())) else tuple(caps)
    table = draw(st.sampled_from(["calibration", "coarse", "none"]))
    if table == "calibration":  # the real thing: counted on another trace of the same shape
        A = coactivation(tie_prone(rng, (30, L, E), 1.0), k)
    elif table == "coarse":  # few distinct values: ties on A, broken by the logit, then the id
        A = rng.integers(0, 3, size=(L, E, E)) / 2.0
    else:
        A = None if policy.substitute_by == "logit" else np.zeros((L, E, E))
    # the predictor: the logits themselves, a noisy copy (often right), or unrelated
    kind = draw(st.sampled_from(["exact", "noisy", "unrelated"]))
    y = {
        "exact": logits,
        "noisy": (logits + tie_prone(rng, logits.shape, 0.5)).astype(np.float32),
        "unrelated": tie_prone(rng, logits.shape, 1.0),
    }[kind]
    lookahead = y if policy.prefetch > 0 or draw(st.booleans()) else None
    return logits, k, capacity, policy, initial, A, lookahead


def assert_same(a, b):
    for f in EXACT:
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    for f in FLOATS:
        np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=0, atol=1e-12, err_msg=f)


def run_both(case):
    logits, k, C, policy, initial, A, y = case
    got = scan(logits, k, C, policy, initial, coactivation=A, lookahead=y)
    want = reference_scan(logits, k, C, policy, initial, coactivation=A, lookahead=y)
    return got, want
