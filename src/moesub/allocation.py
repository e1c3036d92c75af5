"""Planned per-layer slot counts (`allocation: planned`), chosen on the calibration capture only.

For one policy and cache size (C slots per layer, L x C in all): each layer's hits-vs-capacity
curve on the calibration trace, then the split of the L x C slots that maximizes the policy's
hits there. The evaluation streams are never read: the plan is a property of the calibration
capture, like the expert ranking it starts from.

- **Curves** (`hit_curves`): the policy replayed through the grid (`moesub.grid`) at every
  capacity c from the smallest a layer may hold (k, the prefetch and the pin spec:
  `moesub.layout.min_layer_capacity`) to the largest any split can give one layer. Each layer's
  cache is independent of the others', so the grid point "c slots in every layer", started from
  the ranking's first c experts with the pin spec resolved at c, gives every layer's hits at
  C_l = c.
- **Split** (`best_split`): the exact optimum of sum_l hits_l(C_l) subject to sum_l C_l = L x C,
  by dynamic programming over the layers (a max-plus convolution per layer). Greedy on the
  marginal gain is optimal only when every curve is concave, which a cache's need not be (the
  artefact records each layer's concavity). Among equal totals the split nearest uniform
  (smallest sum of |C_l - C|) is kept, so flat curves keep the uniform split.

Anchors from the runtimes people use: ktransformers keeps a global hot-(layer, expert) mask on
the GPU (unequal per-layer budgets from recorded usage); ik_llama.cpp puts the later layers'
experts on the CPU because their routing is more focused. Here the budget per layer follows
the measured curve instead of a rule of thumb.

Entry point: `run_allocation` writes `results/{model}/allocation/{policy}/{size}.json`
(`moesub.layout.read_allocation` reads its capacities back).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moesub.artefacts import load_trace, read_expert_ranking
from moesub.coactivation import read_coactivation
from moesub.grid import COUNTER_NAMES, GridPoint, replay
from moesub.io import write_json
from moesub.layout import build_layout
from moesub.policy import CORE_BUILD_ID
from moesub.slots import CacheSize, min_layer_capacity

# grid points replayed together (each holds a (tokens, L) float64 mass array in the core)
_BATCH = 64


def capacity_range(
    policy: Mapping[str, Any], top_k: int, num_experts: int, num_layers: int, capacity: int
) -> range:
    """The capacities a layer may get: from the smallest its pins and k allow to the largest a
    split of L x C can give one layer (the others at their smallest), at most E."""
    low = min_layer_capacity(policy.get("pin", 0), top_k, policy.get("prefetch", 0), num_experts)
    if low is None or low > capacity:
        raise ValueError(
            f"allocation: no layer can hold the pins {policy.get('pin')!r} with k={top_k} at "
            f"C={capacity} (each layer needs pin_l + max(k, prefetch) <= C_l)"
        )
    high = min(num_experts, num_layers * capacity - (num_layers - 1) * low)
    return range(low, high + 1)


def hit_curves(
    streams: list[np.ndarray],
    top_k: int,
    ranking: np.ndarray,
    policy: Mapping[str, Any],
    capacities: range,
    lookahead: list[np.ndarray] | None = None,
    coactivation: np.ndarray | None = None,
) -> np.ndarray:
    """(len(capacities), L) int64: each layer's hits on `streams` (float32 (T, L, E) each) with
    c slots in every layer, for every c in `capacities`; each c's caches start from the
    ranking's first c experts of each layer, the pin spec resolved at c."""
    L, E = ranking.shape
    uniform = {**policy, "allocation": "uniform"}
    points = []
    for c in capacities:
        layout = build_layout(ranking, CacheSize(f"c{c}", c, c / E), uniform, top_k)
        points.append(GridPoint(f"c{c}", layout.policy(uniform), c, layout.initial_array()))
    hit = COUNTER_NAMES.index("hit")
    hits = np.zeros((len(points), L), np.int64)
    for start in range(0, len(points), _BATCH):
        batch = points[start : start + _BATCH]
        counts = replay(
            streams, top_k, batch, belady=False, lookahead=lookahead, coactivation=coactivation
        ).counters  # (G, L, counters)
        hits[start : start + len(batch)] = counts[:, :, hit]
    return hits


def best_split(
    hits: np.ndarray, capacities: range, total: int, target: int
) -> tuple[tuple[int, ...], int]:
    """The per-layer capacities C_l in `capacities` with sum C_l = `total` that maximize
    sum_l hits[C_l, l] (`hits` (len(capacities), L)), ties to the smallest sum |C_l - target|;
    returns (C_l per layer, their total hits). Exact: dynamic programming over the layers."""
    n, L = hits.shape
    caps = np.asarray(capacities, np.int64)
    # one integer score per choice: hits first, closeness to uniform second (the deviation of
    # all L layers together is < weight, so it never outweighs a single hit)
    weight = L * (int(caps[-1]) + int(target)) + 1
    score = hits.astype(np.int64) * weight - np.abs(caps - target)[:, None]  # (n, L)
    none = np.iinfo(np.int64).min // 4
    best = np.full(total + 1, none, np.int64)
    best[0] = 0  # best[s]: the best score of the layers so far using s slots in all
    choice = np.zeros((L, total + 1), np.int32)
    for layer in range(L):
        new = np.full(total + 1, none, np.int64)
        for i, c in enumerate(caps):
            if c > total:
                break
            cand = best[: total + 1 - c] + score[i, layer]
            better = cand > new[c:]
            new[c:][better] = cand[better]
            choice[layer, c:][better] = c
        best = new
    if best[total] <= none // 2:
        raise ValueError(f"allocation: no split of {total} slots fits the capacities {capacities}")
    split, s = [], total
    for layer in reversed(range(L)):
        c = int(choice[layer, s])
        split.append(c)
        s -= c
    split.reverse()
    total_hits = int(sum(hits[c - capacities.start, layer] for layer, c in enumerate(split)))
    return tuple(split), total_hits


def is_concave(values: np.ndarray) -> bool:
    """Whether a curve's marginal gains never increase (greedy is then optimal)."""
    return bool((np.diff(values, 2) <= 0).all())


def run_allocation(
    calib_router_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    size: float | Mapping[str, Any],
    out_path: str | os.PathLike,
    coactivation_path: str | os.PathLike | None = None,
) -> Path:
    """Plan one (policy, size)'s per-layer capacities on the calibration capture; write the
    JSON artefact: `capacities` (C_l), `pins`, the curves (`curves.capacity`, `curves.hits`
    per capacity and layer, `curves.calls` per layer), `concave` per layer, the objective
    (`planned_hits` vs `uniform_hits` and their hit rates), the size and the calibration source.
    """
    if policy.get("allocation") != "planned":
        raise ValueError(f"policy {name!r}: allocation must be 'planned' to be planned")
    pol = dict(policy)
    trace = load_trace(calib_router_path, lookahead=int(pol.get("prefetch", 0)) > 0)
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    ranking = read_expert_ranking(ranking_path, L, E)
    size = CacheSize.of(size, E)
    table = None
    if pol.get("substitute_by") == "coactivation":
        if coactivation_path is None:
            raise ValueError(f"policy {name!r}: substitute_by='coactivation' needs its table")
        table = read_coactivation(coactivation_path, L, E)
    caps = capacity_range(pol, k, E, L, size.capacity)
    hits = hit_curves(trace.logits, k, ranking, pol, caps, trace.lookahead, table)
    split, planned = best_split(hits, caps, L * size.capacity, size.capacity)
    layout = build_layout(ranking, size, pol, k, split)
    uniform = int(hits[size.capacity - caps.start].sum())
    calls = trace.num_tokens * k  # per layer
    doc = {
        "policy": name,
        "policy_spec": pol,
        "size": size.to_dict(),
        "capacity": size.capacity,
        "num_layers": L,
        "num_experts": E,
        "top_k": k,
        "capacities": list(split),
        "pins": list(layout.pins),
        "objective": "hits on the calibration capture (selections served by a resident expert)",
        "planned_hits": planned,
        "uniform_hits": uniform,
        "planned_hit_rate": planned / (calls * L),
        "uniform_hit_rate": uniform / (calls * L),
        "concave": [is_concave(hits[:, layer]) for layer in range(L)],
        "curves": {"capacity": list(caps), "hits": hits.tolist(), "calls": calls},
        "calibration": {"router": str(calib_router_path), "tokens": trace.num_tokens},
        "core_build_id": CORE_BUILD_ID,
    }
    return write_json(doc, out_path)
