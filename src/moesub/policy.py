"""The policy API: one C++ core (`moesub._core`) behind `scan` and `LayerCache`.

Semantics are docs/policy-semantics.md. `reference_scan` at the bottom of this file is a plain
Python transcription of that text, kept only to test the core against.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from moesub import _core

HIT, FETCH, SUB, HOST, FORCED = 0, 1, 2, 3, 4
STATUS_NAMES = ("hit", "fetch", "sub", "host", "forced")
RULES = ("fetch_all", "substitute_all", "first_choice", "threshold", "host_compute")
EVICTIONS = ("lru", "lfu")
CORE_BUILD_ID: str = _core.BUILD_ID
# Reserved policy name: every expert resident (the engine's floor on time per token).
ALL_RESIDENT = "all_resident"
# The study's named policies, for code that runs without a config (the engine benchmark's
# default set, the regime measurement); config.yaml `policies:` defines the same (a test holds
# them equal).
STUDY_POLICIES: dict[str, dict[str, Any]] = {
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "substitute_all": {"rule": "substitute_all", "eviction": "lru"},
    "rule_015": {"rule": "threshold", "tau": 0.15, "eviction": "lru"},
    "first_choice": {"rule": "first_choice", "eviction": "lru"},
    "quality": {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5},
    "speed": {"rule": "first_choice", "eviction": "lfu", "beta": 0.5},
    "host_compute": {"rule": "host_compute", "eviction": "lru"},
}


@dataclass(frozen=True)
class Policy:
    """A miss rule, an eviction order and (beta > 0) background admission."""

    rule: str = "fetch_all"
    tau: float = 0.0  # threshold rule only: fetch a miss whose gate weight is >= tau
    eviction: str = "lru"
    beta: float = 0.0  # admit an expert once its substituted mass reaches beta; 0 = never
    delay: int = 1  # tokens between an admission request and the expert becoming resident

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"policy rule: unknown rule {self.rule!r}; expected one of {RULES}")
        if self.eviction not in EVICTIONS:
            raise ValueError(
                f"policy eviction: unknown eviction {self.eviction!r}; expected one of {EVICTIONS}"
            )
        if not (math.isfinite(self.tau) and self.tau >= 0):
            raise ValueError(f"policy tau: must be a finite number >= 0, got {self.tau!r}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ValueError(f"policy beta: must be a finite number >= 0, got {self.beta!r}")
        if isinstance(self.delay, bool) or int(self.delay) != self.delay or self.delay < 1:
            raise ValueError(f"policy delay: must be an integer >= 1, got {self.delay!r}")
        if self.rule == "host_compute" and self.beta > 0:
            raise ValueError("policy beta: host_compute never changes the cache; beta must be 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"policy: unknown key(s) {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _core_args(self) -> tuple[int, float, int, float, int]:
        return (
            RULES.index(self.rule),
            float(self.tau),
            EVICTIONS.index(self.eviction),
            float(self.beta),
            int(self.delay),
        )


def capacity_for(fraction: float, num_experts: int) -> int:
    """Resident experts per layer for a cache fraction: C = floor(fraction * E + 0.5) (the
    project's one capacity formula)."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise ValueError(f"fraction: must be a number in (0, 1], got {fraction!r}")
    if not (0 < fraction <= 1):
        raise ValueError(f"fraction: must be in (0, 1], got {fraction!r}")
    return int(math.floor(fraction * num_experts + 0.5))


def check_capacity(fraction: float, num_experts: int, k: int) -> int:
    """`capacity_for(fraction, E)`, checked to hold k <= C <= E (the core needs k slots)."""
    capacity = capacity_for(fraction, num_experts)
    if not k <= capacity <= num_experts:
        raise ValueError(
            f"fraction {fraction} gives capacity C={capacity}, outside [k={k}, E={num_experts}]"
        )
    return capacity


# ---------------------------------------------------------------------------------------------
# argument checks shared by scan / LayerCache / forced_substitution (and every stage that
# takes an initial resident set)


def _check_logits(logits: Any, ndim: int, finite: bool = True) -> np.ndarray:
    """Type, dtype and shape; NaN/inf too unless the caller's core call checks them itself."""
    if not isinstance(logits, np.ndarray):
        raise ValueError(f"logits: expected a numpy array, got {type(logits).__name__}")
    if logits.dtype != np.float32:
        raise ValueError(f"logits: dtype must be float32, got {logits.dtype}")
    if logits.ndim != ndim:
        shape = "(T, L, E)" if ndim == 3 else "(T, E)"
        raise ValueError(f"logits: expected {ndim} dimensions {shape}, got shape {logits.shape}")
    if finite and not np.isfinite(logits).all():
        bad = np.argwhere(~np.isfinite(logits))[0]
        raise ValueError(f"logits: contain NaN or inf (first at index {tuple(bad.tolist())})")
    return np.ascontiguousarray(logits)


def check_sizes(num_experts: int, k: int, capacity: int) -> None:
    for name, v in (("num_experts", num_experts), ("k", k), ("capacity", capacity)):
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"{name}: must be an integer, got {v!r}")
    if not 1 <= k <= min(num_experts, _core.MAX_TOP_K):
        raise ValueError(
            f"k: must be in [1, min(E, {_core.MAX_TOP_K})] with E={num_experts}, got {k}"
        )
    if capacity < k:
        raise ValueError(f"capacity: C={capacity} is smaller than k={k}")
    if capacity > num_experts:
        raise ValueError(f"capacity: C={capacity} exceeds the number of experts E={num_experts}")


def check_initial(initial: Any, shape: tuple[int, ...], num_experts: int) -> np.ndarray | None:
    """An initial resident set of `shape` ((L, C) or (C,)): integer expert ids in [0, E), no
    repeat within a layer; contiguous int32 (None passes through: experts 0..C-1)."""
    if initial is None:
        return None
    arr = np.asarray(initial)
    if arr.shape != shape:
        raise ValueError(f"initial: expected shape {shape}, got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"initial: expected integer expert ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(f"initial: expert ids must be in [0, {num_experts})")
    rows = arr.reshape(-1, shape[-1])
    for i, row in enumerate(rows):
        if len(np.unique(row)) != len(row):
            where = f" (layer {i})" if arr.ndim == 2 else ""
            raise ValueError(f"initial: duplicate expert ids in the resident set{where}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_policy(policy: Any) -> Policy:
    if not isinstance(policy, Policy):
        raise ValueError(f"policy: expected a moesub.policy.Policy, got {type(policy).__name__}")
    return policy


# ---------------------------------------------------------------------------------------------
# whole-stream scan


@dataclass
class ScanResult:
    ids: np.ndarray  # int32 (T, L, k): expert computed in each slot (the substitute for SUB)
    weights: np.ndarray  # float64 (T, L, k): normalized gate weights of the selected experts
    status: np.ndarray  # int8 (T, L, k): HIT / FETCH / SUB / HOST / FORCED
    mass: np.ndarray  # float64 (T, L): substituted mass per token-layer
    selected: np.ndarray  # int32 (T, L, k): the router's top-k by rank

    @classmethod
    def empty(cls, T: int, L: int, k: int) -> ScanResult:
        # One allocation carved into the five arrays: a large block gets huge pages, so filling
        # it costs a few page faults instead of thousands (a sixth of a whole scan's time).
        specs = {
            "ids": ((T, L, k), np.int32),
            "weights": ((T, L, k), np.float64),
            "status": ((T, L, k), np.int8),
            "mass": ((T, L), np.float64),
            "selected": ((T, L, k), np.int32),
        }
        sizes = [-(-math.prod(s) * np.dtype(d).itemsize // 64) * 64 for s, d in specs.values()]
        block = np.empty(sum(sizes), np.uint8)
        arrays, offset = {}, 0
        for (name, (shape, dtype)), size in zip(specs.items(), sizes, strict=True):
            count = math.prod(shape)
            arrays[name] = block[offset : offset + size].view(dtype)[:count].reshape(shape)
            offset += size
        return cls(**arrays)


def _check_scan_args(
    logits: Any, k: int, capacity: int, policy: Any, initial: Any, finite: bool = True
) -> tuple[np.ndarray, np.ndarray | None]:
    logits = _check_logits(logits, 3, finite)
    T, L, E = logits.shape
    check_sizes(E, k, capacity)
    _check_policy(policy)
    return logits, check_initial(initial, (L, capacity), E)


def scan(
    logits: np.ndarray,
    k: int,
    capacity: int,
    policy: Policy,
    initial: np.ndarray | None = None,
) -> ScanResult:
    """Replay a whole (T, L, E) float32 trace through the policy; every layer has its own cache."""
    # the core checks for NaN/inf while it reads the logits (a separate pass costs a third of it)
    logits, init = _check_scan_args(logits, k, capacity, policy, initial, finite=False)
    r = ScanResult.empty(*logits.shape[:2], k)
    _core.scan(
        logits,
        k,
        capacity,
        *policy._core_args(),
        init,
        r.ids,
        r.weights,
        r.status,
        r.selected,
        r.mass,
    )
    return r


# ---------------------------------------------------------------------------------------------
# streaming form: one layer's state carried across calls


@dataclass
class LayerStep:
    ids: np.ndarray  # int32 (T, k)
    weights: np.ndarray  # float64 (T, k)
    status: np.ndarray  # int8 (T, k)
    selected: np.ndarray  # int32 (T, k)
    slot: np.ndarray  # int32 (T, k): cache slot of the computed expert, -1 for HOST
    mass: np.ndarray  # float64 (T,)
    admissions: np.ndarray  # int64 (n, 2): (token, expert) admission requests made in this call


class LayerCache:
    """One MoE layer's cache and policy state, stepped over a token stream chunk by chunk.

    Stepping over a stream in chunks of any size gives exactly the result of one `scan`. With
    `external_admission=True` admissions are not applied after `delay` tokens: the caller copies
    the expert in the background and calls `admit(expert)` when the copy has completed.
    """

    def __init__(
        self,
        num_experts: int,
        k: int,
        capacity: int,
        policy: Policy,
        initial: np.ndarray | None = None,
        external_admission: bool = False,
    ) -> None:
        check_sizes(num_experts, k, capacity)
        self.policy = _check_policy(policy)
        self.num_experts, self.k, self.capacity = int(num_experts), int(k), int(capacity)
        init = check_initial(initial, (capacity,), num_experts)
        self._core = _core.LayerCache(
            self.num_experts,
            self.k,
            self.capacity,
            *policy._core_args(),
            init,
            bool(external_admission),
        )

    def step(self, logits: np.ndarray) -> LayerStep:
        logits = _check_logits(logits, 2)
        T, E = logits.shape
        if self.num_experts != E:
            raise ValueError(f"logits: expected {self.num_experts} experts per row, got {E}")
        k = self.k
        s = LayerStep(
            ids=np.empty((T, k), np.int32),
            weights=np.empty((T, k), np.float64),
            status=np.empty((T, k), np.int8),
            selected=np.empty((T, k), np.int32),
            slot=np.empty((T, k), np.int32),
            mass=np.empty(T, np.float64),
            admissions=np.empty((0, 2), np.int64),
        )
        adm = self._core.step(logits, s.ids, s.weights, s.status, s.selected, s.slot, s.mass)
        if adm:
            s.admissions = np.asarray(adm, dtype=np.int64)
        return s

    def admit(self, expert: int) -> tuple[int, int]:
        """External admission: the copy of `expert` completed. Returns (slot, evicted or -1)."""
        return self._core.admit(int(expert))

    def resident(self) -> np.ndarray:
        """(C,) int32: the expert held in each slot."""
        return np.asarray(self._core.resident(), dtype=np.int32)

    def pending(self, expert: int) -> bool:
        return self._core.pending(int(expert))

    @property
    def t(self) -> int:
        return self._core.t

    def counters(self) -> dict[str, int]:
        return self._core.counters()


def forced_substitution(
    logits: np.ndarray, k: int, resident: np.ndarray, sub_mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Experiment B: substitute exactly the ranks in `sub_mask` (T, k) from a static resident set.

    Returns (ids, weights, selected), each (T, k): the substitute for each masked rank is the
    core's choice (highest-logit resident expert not in the token's computed set).
    """
    logits = _check_logits(logits, 2)
    T, E = logits.shape
    resident = np.asarray(resident)
    check_sizes(E, k, len(resident))
    res = check_initial(resident, (len(resident),), E)
    mask = np.asarray(sub_mask)
    if mask.shape != (T, k):
        raise ValueError(f"sub_mask: expected shape {(T, k)}, got {mask.shape}")
    mask = np.ascontiguousarray(mask, dtype=np.uint8)
    ids = np.empty((T, k), np.int32)
    weights = np.empty((T, k), np.float64)
    selected = np.empty((T, k), np.int32)
    _core.forced_substitution(logits, k, res, mask, ids, weights, selected)
    return ids, weights, selected


# ---------------------------------------------------------------------------------------------
# reference implementation: docs/policy-semantics.md, line by line (slow; tests only)


def reference_scan(
    logits: np.ndarray,
    k: int,
    capacity: int,
    policy: Policy,
    initial: np.ndarray | None = None,
) -> ScanResult:
    logits, init = _check_scan_args(logits, k, capacity, policy, initial)
    L = logits.shape[1]
    out = ScanResult.empty(*logits.shape[:2], k)
    for layer in range(L):
        row = list(range(capacity)) if init is None else [int(e) for e in init[layer]]
        _reference_layer(logits[:, layer], k, policy, row, out, layer)
    return out


def _reference_layer(
    logits: np.ndarray, k: int, policy: Policy, resident: list[int], out: ScanResult, layer: int
) -> None:
    """One layer of `reference_scan`: logits (T, E); `resident` is the initial set (mutated)."""
    T, E = logits.shape
    freq = [0] * E
    last = [-1] * E
    acc = [0.0] * E
    pending: dict[int, int] = {}  # expert -> ready time

    def victim(pinned: set[int]) -> int:
        def key(e: int) -> tuple:
            if policy.eviction == "lfu":
                return (freq[e], last[e], e)
            return (last[e], e)

        return min((e for e in resident if e not in pinned), key=key)

    def insert(e: int, pinned: set[int]) -> None:
        # the cache is always full: evict a victim and take its place
        v = victim(pinned)
        resident[resident.index(v)] = e

    for t in range(T):
        z = [float(x) for x in logits[t]]
        # 1. admissions whose ready time has come, in (ready time, id) order
        for _ready, e in sorted((r, e) for e, r in pending.items() if r <= t):
            del pending[e]
            if e not in resident:
                insert(e, pinned=set())
        # 2. selection: k largest logits, ties to the lower id; weights in float64
        S = sorted(range(E), key=lambda e: (-z[e], e))[:k]
        ex = [math.exp(z[e] - z[S[0]]) for e in S]
        total = 0.0
        for x in ex:
            total += x
        w = [x / total for x in ex]
        for e in S:
            freq[e] += 1
        # 3. classify in rank order
        status = []
        for r, e in enumerate(S):
            if e in resident:
                status.append(HIT)
            elif policy.rule == "fetch_all":
                status.append(FETCH)
            elif policy.rule == "substitute_all":
                status.append(SUB)
            elif policy.rule == "first_choice":
                status.append(FETCH if r == 0 else SUB)
            elif policy.rule == "threshold":
                status.append(FETCH if r == 0 or w[r] >= policy.tau else SUB)
            else:
                status.append(HOST)
        ids = list(S)
        computed = {e for r, e in enumerate(S) if status[r] in (HIT, HOST)}
        # 4. fetch in rank order; hits and earlier fetches are pinned
        for r, e in enumerate(S):
            if status[r] == FETCH:
                insert(e, pinned=computed)
                computed.add(e)
                acc[e] = 0.0
        # 5. substitute in rank order
        m = 0.0
        for r, e in enumerate(S):
            if status[r] != SUB:
                continue
            candidates = [x for x in resident if x not in computed]
            if not candidates:
                status[r] = FORCED
                insert(e, pinned=computed)
                computed.add(e)
                acc[e] = 0.0
                continue
            s = min(candidates, key=lambda x: (-z[x], x))
            ids[r] = s
            computed.add(s)
            m += w[r]
            acc[e] += w[r]
            if policy.beta > 0 and acc[e] >= policy.beta and e not in pending:
                pending[e] = t + policy.delay
                acc[e] = 0.0
        # 6. recency
        for x in ids:
            last[x] = t
        out.ids[t, layer] = ids
        out.weights[t, layer] = w
        out.status[t, layer] = status
        out.selected[t, layer] = S
        out.mass[t, layer] = m
