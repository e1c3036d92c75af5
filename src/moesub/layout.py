"""Per-layer cache layouts: what one run's caches start from.

A layout (`CacheLayout`) holds, per MoE layer, the capacity C_l (uniform: every C_l = C of the
cache size; planned: the allocation artefact's, sum C_l = L * C), the initial experts (the
first C_l of the layer's calibration frequency ranking, hottest first, ties to the lower id)
and the pins (the policy's pin spec resolved at C_l: `moesub.slots`). `build_layout` is the one
resolver every stage's layout comes from (`moesub.artefacts.layout_for` reads its inputs);
`CacheLayout.policy` gives the `Policy` the core runs (the pin spec resolved to per-layer ints).
No policy core, no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesub.slots import ALLOCATIONS, CacheSize, layer_pin, policy_fields
from moesub.vocabulary import Policy

# --------------------------------------------------------------------------------------------
# layouts


@dataclass(frozen=True)
class CacheLayout:
    """Per MoE layer: capacity C_l, initial experts (C_l ids, hottest first) and pins.

    `size` is the cache size it was built for (its C is the mean of the C_l); `allocation` says
    how the C_l were chosen (uniform | planned)."""

    size: CacheSize
    allocation: str
    capacities: tuple[int, ...]
    initial: tuple[np.ndarray, ...] = field(repr=False)
    pins: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.capacities)

    @property
    def uniform(self) -> bool:
        return len(set(self.capacities)) == 1

    def initial_array(self) -> np.ndarray:
        """The (L, C) int32 initial sets of a uniform layout."""
        if not self.uniform:
            raise ValueError(
                f"layout: per-layer capacities {list(self.capacities)} are not uniform; there "
                "is no (L, C) initial array"
            )
        return np.stack(self.initial)

    def pin(self) -> int | tuple[int, ...]:
        """The `Policy.pin` of the layout: one int when every layer pins the same count."""
        return self.pins[0] if len(set(self.pins)) == 1 else self.pins

    def policy(self, spec: Mapping[str, Any] | Policy) -> Policy:
        """The Policy the core runs: `spec`'s fields with the pin spec resolved per layer."""
        fields = policy_fields(spec)
        return Policy.from_dict(fields | ({"pin": self.pin()} if any(self.pins) else {}))

    def run_metadata(self, name: str, policy: Mapping[str, Any]) -> dict[str, Any]:
        """What every artefact of a policy run records about it: the policy as configured, the
        cache size and this layout (simulate, emulate and generation write these keys)."""
        return {
            "policy": dict(policy),
            "name": name,
            "fraction": self.size.fraction,
            "capacity": self.size.capacity,
            "size": self.size.to_dict(),
            "layout": self.to_dict(),
        }

    def to_dict(self) -> dict[str, Any]:
        """Artefact metadata: the size, the allocation, per-layer capacities and pins."""
        return {
            "size": self.size.to_dict(),
            "allocation": self.allocation,
            "capacities": list(self.capacities),
            "pins": list(self.pins),
        }


def check_ranking(ranking: Any, num_layers: int, num_experts: int) -> np.ndarray:
    """A per-layer expert ranking: (L, E) ints, each row a permutation of 0..E-1."""
    arr = np.asarray(ranking)
    if arr.shape != (num_layers, num_experts) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"expert ranking: expected ({num_layers}, {num_experts}) integer expert ids (L "
            f"layers x E experts of the model), got {arr.dtype} {arr.shape}"
        )
    if not (np.sort(arr, axis=1) == np.arange(num_experts)).all():
        raise ValueError("expert ranking: every layer must rank each expert 0..E-1 once")
    return np.ascontiguousarray(arr, dtype=np.int32)


def build_layout(
    ranking: np.ndarray,
    size: float | Mapping[str, Any] | CacheSize,
    policy: Mapping[str, Any] | Policy,
    top_k: int,
    allocation: Sequence[int] | None = None,
) -> CacheLayout:
    """The one resolver: the layout of `policy` at `size` from the (L, E) expert `ranking`.

    `policy`: a config policy dict (its `allocation`, default uniform, and `pin` spec, default
    0) or a `Policy`. `allocation`: the planned per-layer capacities (`read_allocation`),
    required by and only allowed for `allocation: planned`; they must sum to L * C. Every layer
    must hold k <= C_l <= E and pin_l + max(k, prefetch) <= C_l (errors name the layer)."""
    L, E = np.shape(ranking)
    ranking = check_ranking(ranking, L, E)
    size = CacheSize.of(size, E)
    spec = policy.to_dict() if isinstance(policy, Policy) else dict(policy)
    how = spec.get("allocation", "uniform")
    if how not in ALLOCATIONS:
        raise ValueError(f"policy allocation: {how!r}; expected one of {ALLOCATIONS}")
    if (allocation is None) != (how == "uniform"):
        raise ValueError(
            "allocation: a planned policy needs the planned per-layer capacities "
            "(results/{model}/allocation/{policy}/{size}.json); a uniform one takes none"
        )
    caps = (size.capacity,) * L if allocation is None else tuple(int(c) for c in allocation)
    if len(caps) != L or sum(caps) != L * size.capacity:
        raise ValueError(
            f"allocation: {list(caps)} must give each of the {L} layers a capacity, summing to "
            f"L x C = {L} x {size.capacity} = {L * size.capacity} (size {size.label})"
        )
    prefetch = int(spec.get("prefetch", 0))
    pins = []
    for layer, cap in enumerate(caps):
        if not top_k <= cap <= E:
            raise ValueError(
                f"layout: layer {layer} gets C_l={cap}, outside [k={top_k}, E={E}] "
                f"(size {size.label})"
            )
        try:
            pins.append(layer_pin(spec.get("pin", 0), cap, top_k, prefetch))
        except ValueError as e:
            raise ValueError(f"layout: layer {layer} at size {size.label}: {e}") from None
    initial = tuple(ranking[layer, :cap].copy() for layer, cap in enumerate(caps))
    return CacheLayout(size, how, caps, initial, tuple(pins))


def read_allocation(path: str | os.PathLike, num_layers: int, capacity: int) -> tuple[int, ...]:
    """The per-layer capacities of an allocation artefact (`moesub.allocation`), checked to
    cover `num_layers` layers and sum to num_layers * capacity."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"allocation {str(path)!r} does not exist")
    doc = json.loads(path.read_text())
    caps = doc.get("capacities") if isinstance(doc, dict) else None
    if not isinstance(caps, list) or len(caps) != num_layers:
        raise ValueError(f"allocation {str(path)!r}: expected {num_layers} per-layer capacities")
    if doc.get("capacity") != capacity or sum(caps) != num_layers * capacity:
        raise ValueError(
            f"allocation {str(path)!r} was planned for C={doc.get('capacity')} (sum "
            f"{sum(caps)}), not this size's C={capacity} (sum {num_layers * capacity})"
        )
    return tuple(int(c) for c in caps)
