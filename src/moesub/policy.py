"""The policy API: one C++ core (`moesub._core`) behind `scan` and `LayerCache`.

Semantics are docs/policy-semantics.md. The vocabulary (`Policy`, status codes, rules,
`capacity_for`, ...) lives in `moesub.vocabulary`, which does not load the core, and is
re-exported here: `from moesub.policy import Policy, STATUS_NAMES` is the stable API.
`moesub.policy_reference.reference_scan` is a plain Python transcription of the semantics, kept
only to test the core against.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moesub import _core
from moesub.vocabulary import (
    ALL_RESIDENT,
    ALL_RESIDENT_POLICY,
    EVICTIONS,
    FETCH,
    FORCED,
    HIT,
    HOST,
    LIGHT_MISSES,
    OFFLINE_EVICTIONS,
    RULES,
    STATUS_NAMES,
    STUDY_POLICIES,
    SUB,
    SUBSTITUTE_BY,
    TOKEN_LAYER_FIELDS,
    Policy,
    capacity_for,
    check_capacity,
)

__all__ = [
    "ALL_RESIDENT",
    "ALL_RESIDENT_POLICY",
    "CORE_BUILD_ID",
    "EVICTIONS",
    "FETCH",
    "FORCED",
    "HIT",
    "HOST",
    "LIGHT_MISSES",
    "OFFLINE_EVICTIONS",
    "RULES",
    "STATUS_NAMES",
    "STUDY_POLICIES",
    "SUB",
    "SUBSTITUTE_BY",
    "TOKEN_LAYER_DTYPE",
    "TOKEN_LAYER_FIELDS",
    "LayerCache",
    "LayerStep",
    "Layers",
    "Policy",
    "ScanResult",
    "capacity_for",
    "check_capacity",
    "check_coactivation",
    "check_initial",
    "check_layers",
    "check_lookahead",
    "check_logits",
    "check_scan_args",
    "check_sizes",
    "forced_substitution",
    "scan",
    "token_layer_counts",
]

CORE_BUILD_ID: str = _core.BUILD_ID


# ---------------------------------------------------------------------------------------------
# argument checks shared by scan / LayerCache / forced_substitution (and every stage that
# takes an initial resident set)


def check_logits(logits: Any, ndim: int, finite: bool = True) -> np.ndarray:
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


def check_sizes(num_experts: int, k: int, capacity: int, layer: int | None = None) -> None:
    """E, k and one layer's capacity C: integers with 1 <= k <= C <= E (`layer` names it)."""
    for name, v in (("num_experts", num_experts), ("k", k), ("capacity", capacity)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or int(v) != v:
            raise ValueError(f"{name}: must be an integer, got {v!r}")
    if not 1 <= k <= min(num_experts, _core.MAX_TOP_K):
        raise ValueError(
            f"k: must be in [1, min(E, {_core.MAX_TOP_K})] with E={num_experts}, got {k}"
        )
    where = "" if layer is None else f" in layer {layer}"
    if capacity < k:
        raise ValueError(f"capacity: C={capacity}{where} is smaller than k={k}")
    if capacity > num_experts:
        raise ValueError(
            f"capacity: C={capacity}{where} exceeds the number of experts E={num_experts}"
        )


def check_initial(
    initial: Any, shape: tuple[int, ...], num_experts: int, layer: int | None = None
) -> np.ndarray | None:
    """An initial resident set of `shape` ((L, C) or (C,)): integer expert ids in [0, E), no
    repeat within a layer; contiguous int32 (None passes through: experts 0..C-1). `layer`
    names a (C,) set's layer in the errors."""
    if initial is None:
        return None
    where = "" if layer is None else f" (layer {layer})"
    arr = np.asarray(initial)
    if arr.shape != shape:
        raise ValueError(f"initial: expected shape {shape}{where}, got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"initial: expected integer expert ids{where}, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(f"initial: expert ids must be in [0, {num_experts}){where}")
    rows = arr.reshape(-1, shape[-1])
    for i, row in enumerate(rows):
        if len(np.unique(row)) != len(row):
            where = f" (layer {i})" if arr.ndim == 2 else where
            raise ValueError(f"initial: duplicate expert ids in the resident set{where}")
    return np.ascontiguousarray(arr, dtype=np.int32)


@dataclass(frozen=True)
class Layers:
    """Per MoE layer: its capacity, its pinned count and its initial resident set."""

    capacities: tuple[int, ...]  # C_l
    pins: tuple[int, ...]  # pin_l: slots 0..pin_l-1 (the initial set's first experts) stay
    initials: list[np.ndarray]  # int32 (C_l,) each: the expert that starts in each slot


def check_layers(
    policy: Policy, k: int, capacity: Any, initial: Any, num_layers: int, num_experts: int
) -> Layers:
    """The per-layer cache of `scan`, `LayerCache`s and the grid, checked before any work.

    `capacity`: an int (every layer) or a sequence of L ints, each with k <= C_l <= E.
    `initial`: None (experts 0..C_l-1), an (L, C) array (all C_l equal), or a sequence of L 1-D
    arrays of lengths C_l. The policy's pin (an int or L ints) and prefetch must fit every layer
    (`Policy.check_fit`). Errors name the layer.
    """
    L, E = num_layers, num_experts
    if isinstance(capacity, Sequence) or getattr(capacity, "ndim", 0) == 1:
        capacities = tuple(capacity)
        if len(capacities) != L:
            raise ValueError(f"capacity: {len(capacities)} per-layer capacities for {L} layers")
        for layer, C in enumerate(capacities):
            check_sizes(E, k, C, layer)
    else:
        check_sizes(E, k, capacity)
        capacities = (capacity,) * L
    capacities = tuple(int(C) for C in capacities)
    pins = _check_policy(policy).layer_pins(L)
    for layer, C in enumerate(capacities):
        policy.for_layer(layer).check_fit(k, C, layer)
    if initial is None:
        initials = [np.arange(C, dtype=np.int32) for C in capacities]
    elif isinstance(initial, np.ndarray) and initial.ndim != 1:
        if len(set(capacities)) > 1:
            raise ValueError(
                f"initial: per-layer capacities {capacities} need a sequence of L 1-D arrays, "
                f"got an array of shape {initial.shape}"
            )
        initials = list(check_initial(initial, (L, capacities[0]), E))
    else:
        if not isinstance(initial, Sequence | np.ndarray):
            raise ValueError(
                "initial: expected None, an (L, C) array or a sequence of L 1-D arrays, got "
                f"{type(initial).__name__}"
            )
        if len(initial) != L:
            raise ValueError(f"initial: {len(initial)} per-layer sets for {L} layers")
        initials = [
            check_initial(row, (C,), E, layer)
            for layer, (row, C) in enumerate(zip(initial, capacities, strict=True))
        ]
    return Layers(capacities, pins, initials)


def _check_policy(policy: Any) -> Policy:
    if not isinstance(policy, Policy):
        raise ValueError(f"policy: expected a moesub.policy.Policy, got {type(policy).__name__}")
    return policy


def check_lookahead(policy: Policy, lookahead: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """Prefetch's lookahead logits: float32 of the logits' shape, needed iff prefetch > 0 (the
    core checks them for NaN/inf as it reads them, like the logits). None if unused."""
    if lookahead is None:
        if policy.prefetch > 0:
            raise ValueError("lookahead: policy prefetch > 0 needs the lookahead logits")
        return None
    if not isinstance(lookahead, np.ndarray) or lookahead.dtype != np.float32:
        raise ValueError("lookahead: expected a float32 numpy array")
    if lookahead.shape != shape:
        raise ValueError(f"lookahead: expected the logits' shape {shape}, got {lookahead.shape}")
    return np.ascontiguousarray(lookahead) if policy.prefetch > 0 else None


def check_coactivation(
    policy: Policy, coactivation: Any, shape: tuple[int, ...]
) -> np.ndarray | None:
    """substitute_by='coactivation''s table (`coactivation()`), as float64. None if unused."""
    if coactivation is None:
        if policy.substitute_by == "coactivation":
            raise ValueError(
                "coactivation: substitute_by='coactivation' needs the co-activation table "
                "(moesub.coactivation.coactivation of the calibration trace)"
            )
        return None
    A = np.asarray(coactivation)
    if A.shape != shape:
        raise ValueError(f"coactivation: expected shape {shape}, got {A.shape}")
    if not np.issubdtype(A.dtype, np.floating) or not np.isfinite(A).all():
        raise ValueError("coactivation: expected finite floating-point values")
    if policy.substitute_by != "coactivation":
        return None
    return np.ascontiguousarray(A, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# whole-stream scan


@dataclass
class ScanResult:
    ids: np.ndarray  # int32 (T, L, k): expert computed in each slot (the substitute for SUB)
    weights: np.ndarray  # float64 (T, L, k): normalized gate weights of the selected experts
    status: np.ndarray  # int8 (T, L, k): HIT / FETCH / SUB / HOST / FORCED
    mass: np.ndarray  # float64 (T, L): substituted mass per token-layer
    selected: np.ndarray  # int32 (T, L, k): the selection S by rank (v1: the router's top-k)
    rerouted: np.ndarray  # float64 (T, L): mass route_bias moved off the unbiased top-k
    prefetched: np.ndarray  # int32 (T, L): experts inserted by prefetch (step 1b)
    requested: np.ndarray  # int32 (T, L): admission requests (beta admissions, host uploads)
    admitted: np.ndarray  # int32 (T, L): admissions landed (experts inserted) in step 1

    @classmethod
    def empty(cls, T: int, L: int, k: int) -> ScanResult:
        # One allocation carved into the arrays: a large block gets huge pages, so filling
        # it costs a few page faults instead of thousands (a sixth of a whole scan's time).
        specs = {
            "ids": ((T, L, k), np.int32),
            "weights": ((T, L, k), np.float64),
            "status": ((T, L, k), np.int8),
            "mass": ((T, L), np.float64),
            "selected": ((T, L, k), np.int32),
            "rerouted": ((T, L), np.float64),
            "prefetched": ((T, L), np.int32),
            "requested": ((T, L), np.int32),
            "admitted": ((T, L), np.int32),
        }
        sizes = [-(-math.prod(s) * np.dtype(d).itemsize // 64) * 64 for s, d in specs.values()]
        block = np.empty(sum(sizes), np.uint8)
        arrays, offset = {}, 0
        for (name, (shape, dtype)), size in zip(specs.items(), sizes, strict=True):
            count = math.prod(shape)
            arrays[name] = block[offset : offset + size].view(dtype)[:count].reshape(shape)
            offset += size
        return cls(**arrays)


def check_scan_args(
    logits: Any,
    k: int,
    capacity: Any,
    policy: Any,
    initial: Any,
    lookahead: Any = None,
    coactivation: Any = None,
    finite: bool = True,
) -> tuple[np.ndarray, Layers, np.ndarray | None, np.ndarray | None]:
    """The arguments of `scan` (and `reference_scan`), checked: (logits, per-layer caches,
    lookahead, coactivation) as the core takes them."""
    logits = check_logits(logits, 3, finite)
    T, L, E = logits.shape
    layers = check_layers(policy, k, capacity, initial, L, E)
    y = check_lookahead(policy, lookahead, logits.shape)
    return logits, layers, y, check_coactivation(policy, coactivation, (L, E, E))


def scan(
    logits: np.ndarray,
    k: int,
    capacity: int | Sequence[int],
    policy: Policy,
    initial: np.ndarray | Sequence[np.ndarray] | None = None,
    coactivation: np.ndarray | None = None,
    lookahead: np.ndarray | None = None,
) -> ScanResult:
    """Replay a whole (T, L, E) float32 trace through the policy; every layer has its own cache.

    `capacity`: an int or one per layer; `initial`: None (experts 0..C_l-1), an (L, C) array or
    L 1-D arrays of lengths C_l (the policy's pin counts from their front). `lookahead`
    (float32, the logits' shape) feeds prefetch; `coactivation` ((L, E, E), see
    `coactivation()`) feeds substitute_by='coactivation'.
    """
    # the core checks for NaN/inf while it reads the logits (a separate pass costs a third of it)
    logits, layers, y, A = check_scan_args(
        logits, k, capacity, policy, initial, lookahead, coactivation, finite=False
    )
    r = ScanResult.empty(*logits.shape[:2], k)
    _core.scan(
        logits, k, layers.capacities, policy._core_args(), layers.pins, layers.initials, y, A,
        r.ids, r.weights, r.status, r.selected, r.mass, r.rerouted, r.prefetched, r.requested,
        r.admitted,
    )  # fmt: skip
    return r


# The dtype of token-layer counts (`token_layer_counts`, the grid's `token_counts`): every count
# is at most E (admissions landing at once), and checked to fit.
TOKEN_LAYER_DTYPE = np.int16


def token_layer_counts(result: ScanResult | LayerStep) -> np.ndarray:
    """What the policy did at each token-layer, (..., len(TOKEN_LAYER_FIELDS)) int16 in
    `TOKEN_LAYER_FIELDS` order: (T, L, F) from a `ScanResult`, (T, F) from a `LayerStep`.

    A `LayerStep` of external admission counts no landing (`admitted` is 0: the caller's
    `admit()` calls land them, between tokens)."""
    per_status = [(result.status == code).sum(-1) for code in range(len(STATUS_NAMES))]
    fields = [*per_status, result.prefetched, result.requested, result.admitted]
    out = np.stack(fields, axis=-1)
    if out.size and out.max() > np.iinfo(TOKEN_LAYER_DTYPE).max:
        raise ValueError(f"token-layer counts: a count exceeds {TOKEN_LAYER_DTYPE.__name__}")
    return out.astype(TOKEN_LAYER_DTYPE)


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
    rerouted: np.ndarray  # float64 (T,)
    prefetched: np.ndarray  # int32 (T,)
    requested: np.ndarray  # int32 (T,): admission requests (beta admissions, host uploads)
    admitted: np.ndarray  # int32 (T,): admissions landed in step 1 (0 with external admission)
    admissions: np.ndarray  # int64 (n, 2): (token, expert) admission requests made in this call


class LayerCache:
    """One MoE layer's cache and policy state, stepped over a token stream chunk by chunk.

    Stepping over a stream in chunks of any size gives exactly the result of one `scan`. With
    `external_admission=True` admissions are not applied after `delay` tokens: the caller copies
    the expert in the background and calls `admit(expert)` when the copy has completed; beta's
    admissions and host uploads (host_admit) alike. The policy's pin is an int
    (`Policy.for_layer`): the first `pin` experts of `initial` stay resident.
    `coactivation` is the layer's (E, E) table (substitute_by='coactivation'); prefetch needs
    each step's lookahead rows. Eviction 'belady' needs the future and is rejected here.
    """

    def __init__(
        self,
        num_experts: int,
        k: int,
        capacity: int,
        policy: Policy,
        initial: np.ndarray | None = None,
        external_admission: bool = False,
        coactivation: np.ndarray | None = None,
    ) -> None:
        check_sizes(num_experts, k, capacity)
        self.policy = _check_policy(policy)
        if policy.eviction in OFFLINE_EVICTIONS:
            raise ValueError(
                f"policy eviction: {policy.eviction!r} needs the whole stream's future; it runs "
                "in scan and the simulator only, not in the streaming LayerCache"
            )
        self.num_experts, self.k, self.capacity = int(num_experts), int(k), int(capacity)
        init = check_initial(initial, (capacity,), num_experts)
        E = self.num_experts
        policy.check_fit(self.k, self.capacity)  # the lookahead itself comes with each step
        self._coactivation = check_coactivation(policy, coactivation, (E, E))
        self._core = _core.LayerCache(
            E,
            self.k,
            self.capacity,
            policy._core_args(),
            policy.pin,
            init,
            bool(external_admission),
            self._coactivation,  # kept on self: the core holds a pointer into it
        )

    def step(self, logits: np.ndarray, lookahead: np.ndarray | None = None) -> LayerStep:
        """Step T tokens: logits (T, E) float32; lookahead (T, E) float32 when prefetch > 0."""
        logits = check_logits(logits, 2)
        T, E = logits.shape
        if self.num_experts != E:
            raise ValueError(f"logits: expected {self.num_experts} experts per row, got {E}")
        y = check_lookahead(self.policy, lookahead, logits.shape)
        k = self.k
        s = LayerStep(
            ids=np.empty((T, k), np.int32),
            weights=np.empty((T, k), np.float64),
            status=np.empty((T, k), np.int8),
            selected=np.empty((T, k), np.int32),
            slot=np.empty((T, k), np.int32),
            mass=np.empty(T, np.float64),
            rerouted=np.empty(T, np.float64),
            prefetched=np.empty(T, np.int32),
            requested=np.empty(T, np.int32),
            admitted=np.empty(T, np.int32),
            admissions=np.empty((0, 2), np.int64),
        )
        adm = self._core.step(
            logits, y, s.ids, s.weights, s.status, s.selected, s.slot, s.mass, s.rerouted,
            s.prefetched, s.requested, s.admitted,
        )  # fmt: skip
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
    logits = check_logits(logits, 2)
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
