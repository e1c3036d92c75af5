"""The policy semantics (docs/policy-semantics.md) in plain Python, line by line.

`reference_scan` takes the arguments of `moesub.policy.scan` and returns the same `ScanResult`;
it is slow and exists only so that the C++ core can be tested against the text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from moesub.policy import FETCH, FORCED, HIT, HOST, SUB, Policy, ScanResult, check_scan_args


def reference_scan(
    logits: np.ndarray,
    k: int,
    capacity: int | Sequence[int],
    policy: Policy,
    initial: np.ndarray | Sequence[np.ndarray] | None = None,
    coactivation: np.ndarray | None = None,
    lookahead: np.ndarray | None = None,
) -> ScanResult:
    logits, layers, y, A = check_scan_args(
        logits, k, capacity, policy, initial, lookahead, coactivation
    )
    if y is not None and not np.isfinite(y).all():
        bad = np.argwhere(~np.isfinite(y))[0]
        raise ValueError(f"lookahead: contain NaN or inf (first at index {tuple(bad.tolist())})")
    L = logits.shape[1]
    out = ScanResult.empty(*logits.shape[:2], k)
    for layer in range(L):
        _reference_layer(
            logits[:, layer],
            k,
            policy.for_layer(layer),
            [int(e) for e in layers.initials[layer]],
            out,
            layer,
            None if y is None else y[:, layer],
            None if A is None else A[layer],
        )
    return out


def _reference_topk(z: list[float], k: int) -> list[int]:
    """The k largest values, ranked descending, ties to the lower id."""
    return sorted(range(len(z)), key=lambda e: (-z[e], e))[:k]


def _reference_weights(z: list[float], S: list[int]) -> list[float]:
    """Softmax of z over S against S's largest logit, summed in S's order (float64)."""
    top = max(z[e] for e in S)
    ex = [math.exp(z[e] - top) for e in S]
    total = 0.0
    for x in ex:
        total += x
    return [x / total for x in ex]


def _reference_layer(
    logits: np.ndarray,
    k: int,
    policy: Policy,
    resident: list[int],
    out: ScanResult,
    layer: int,
    lookahead: np.ndarray | None,
    coactivation: np.ndarray | None,
) -> None:
    """One layer of `reference_scan`: logits (T, E); `resident` is the initial set (mutated);
    the policy's pin is this layer's int; lookahead (T, E) for prefetch, coactivation (E, E) for
    substitute_by='coactivation'."""
    T, E = logits.shape
    pinned_for_good = set(resident[: policy.pin])  # never a victim in any step
    freq = [0] * E
    last = [-1] * E
    acc = [0.0] * E
    pending: dict[int, int] = {}  # expert -> ready time
    uses: list[list[int]] = [[] for _ in range(E)]  # belady: the tokens that select each expert
    if policy.eviction == "belady":  # route_bias is 0: the selection is the unbiased top-k
        for t in range(T):
            for e in _reference_topk([float(x) for x in logits[t]], k):
                uses[e].append(t)

    def next_use(e: int, start: int) -> float:
        return next((u for u in uses[e] if u >= start), math.inf)

    def victim(pinned: set[int], now: int) -> int:
        # now: the first token whose selection counts as "next" (belady)
        def key(e: int) -> tuple:
            if policy.eviction == "lfu":
                return (freq[e], last[e], e)
            if policy.eviction == "belady":
                return (-next_use(e, now), e)
            return (last[e], e)

        allowed = (e for e in resident if e not in pinned and e not in pinned_for_good)
        return min(allowed, key=key)

    def insert(e: int, pinned: set[int], now: int) -> None:
        # the cache is always full: evict a victim and take its place
        v = victim(pinned, now)
        resident[resident.index(v)] = e

    for t in range(T):
        z = [float(x) for x in logits[t]]
        # 1. admissions whose ready time has come, in (ready time, id) order
        n_admitted = 0
        for _ready, e in sorted((r, e) for e, r in pending.items() if r <= t):
            del pending[e]
            if e not in resident:
                insert(e, pinned=set(), now=t)
                n_admitted += 1
        # 1b. prefetch the n largest lookahead logits; all of P is pinned meanwhile
        n_prefetched = 0
        if policy.prefetch > 0:
            P = _reference_topk([float(x) for x in lookahead[t]], policy.prefetch)
            for e in P:
                if e not in resident:
                    insert(e, pinned=set(P), now=t)
                    acc[e] = 0.0
                    n_prefetched += 1
        # 2. selection: k largest logits, ties to the lower id; weights in float64. With
        # route_bias the residents' logits are raised by lambda times the row's range.
        T0 = _reference_topk(z, k)
        w0 = _reference_weights(z, T0)
        S, w, rho = T0, w0, 0.0
        if policy.route_bias > 0:
            b = policy.route_bias * (max(z) - min(z))
            biased = [z[e] + b if e in resident else z[e] for e in range(E)]
            S = _reference_topk(biased, k)
            w = _reference_weights(z, S)
            for r, e in enumerate(T0):
                if e not in S:
                    rho += w0[r]
        for e in S:
            freq[e] += 1
        # 3. classify in rank order
        status = []
        for r, e in enumerate(S):
            if e in resident:
                s = HIT
            elif policy.rule == "fetch_all":
                s = FETCH
            elif policy.rule == "substitute_all":
                s = SUB
            elif policy.rule == "first_choice":
                s = FETCH if r == 0 else SUB
            elif policy.rule == "threshold":
                s = FETCH if r == 0 or w[r] >= policy.tau else SUB
            else:
                s = HOST
            if s == SUB and policy.light_miss == "host":
                s = HOST
            status.append(s)
        ids = list(S)
        computed = {e for r, e in enumerate(S) if status[r] in (HIT, HOST)}
        # 4. fetch in rank order; hits and earlier fetches are pinned
        for r, e in enumerate(S):
            if status[r] == FETCH:
                insert(e, pinned=computed, now=t + 1)
                computed.add(e)
                acc[e] = 0.0
        # 5. substitute in rank order
        m = 0.0
        n_requested = 0
        for r, e in enumerate(S):
            if status[r] != SUB:
                continue
            candidates = [x for x in resident if x not in computed]
            if not candidates:
                status[r] = FORCED
                insert(e, pinned=computed, now=t + 1)
                computed.add(e)
                acc[e] = 0.0
                continue
            if policy.substitute_by == "coactivation":
                s = min(candidates, key=lambda x: (-coactivation[e, x], -z[x], x))
            else:
                s = min(candidates, key=lambda x: (-z[x], x))
            ids[r] = s
            computed.add(s)
            m += w[r]
            acc[e] += w[r]
            if policy.beta > 0 and acc[e] >= policy.beta and e not in pending:
                pending[e] = t + policy.delay
                acc[e] = 0.0
                n_requested += 1
        # host uploads: HOST experts in rank order without a pending admission, at most
        # host_admit of them; acc untouched
        uploads = [e for r, e in enumerate(S) if status[r] == HOST and e not in pending]
        for e in uploads[: policy.host_admit]:
            pending[e] = t + policy.delay
            n_requested += 1
        # 6. recency
        for x in ids:
            last[x] = t
        out.ids[t, layer] = ids
        out.weights[t, layer] = w
        out.status[t, layer] = status
        out.selected[t, layer] = S
        out.mass[t, layer] = m
        out.rerouted[t, layer] = rho
        out.prefetched[t, layer] = n_prefetched
        out.requested[t, layer] = n_requested
        out.admitted[t, layer] = n_admitted
