"""Grid replay: router-logit streams through a grid of policies x cache sizes.

The replay itself is the C++ policy core (`_core.simulate_grid`, threads over grid points and
layers); `simulate` checks the streams and the grid, turns the core's counters into rates and
mass quantiles, and prices each grid point with a `moesub.cost.CostModel`. The simulate stage
(`moesub.simulate`) and the regime measurement (`moesub.regime`) both replay through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moesub import _core
from moesub.cost import CostModel
from moesub.policy import (
    STATUS_NAMES,
    Policy,
    capacity_for,
    check_coactivation,
    check_initial,
    check_lookahead,
    check_sizes,
)

# The core's counters in its order (csrc/policy.hpp `Counters`): one per status code between the
# token count and the cache's own events.
COUNTER_NAMES = (
    "tokens", *STATUS_NAMES, "admission_requests", "admissions", "evictions", "prefetches"
)  # fmt: skip


@dataclass(frozen=True)
class GridPoint:
    """One point of the grid: a named policy at a cache fraction."""

    name: str
    policy: Policy
    fraction: float


def counter_row(
    point: GridPoint, capacity: int, layer: int, counts: np.ndarray, k: int
) -> dict[str, Any]:
    """A replay table row's leading columns: the grid point, the layer (-1: all layers), the
    core's counters (`counts` in COUNTER_NAMES order) and the hit and substitution rates."""
    c = dict(zip(COUNTER_NAMES, counts.tolist(), strict=True))
    calls = c["tokens"] * k
    return {
        "policy": point.name,
        "fraction": point.fraction,
        "capacity": capacity,
        "layer": layer,
        **c,
        "hit_rate": c["hit"] / calls,
        "sub_rate": c["sub"] / calls,
    }


def simulate(
    streams: list[np.ndarray],
    k: int,
    grid: list[GridPoint],
    initial_sets: dict[int, np.ndarray] | None = None,
    cost: CostModel | None = None,
    n_threads: int | None = None,
    belady: bool = True,
    lookahead: list[np.ndarray] | None = None,
    coactivation: np.ndarray | None = None,
) -> pl.DataFrame:
    """Replay every stream (float32 (T, L, E); caches restart per stream) for every grid point.

    `initial_sets` maps a capacity to its (L, C) resident set (default: experts 0..C-1).
    `lookahead` holds each stream's lookahead logits (prefetch), `coactivation` the (L, E, E)
    table (substitute_by='coactivation'); see moesub.policy.scan.
    Returns one row per grid point and layer, plus a total row per grid point (layer = -1).
    """
    if not streams:
        raise ValueError("streams: need at least one router-logit stream")
    shapes = {s.shape[1:] for s in streams}
    if len(shapes) != 1:
        raise ValueError(f"streams: all streams need the same (L, E); got {sorted(shapes)}")
    for i, s in enumerate(streams):
        if s.dtype != np.float32 or s.ndim != 3:
            raise ValueError(f"streams[{i}]: expected float32 (T, L, E), got {s.dtype} {s.shape}")
        if not np.isfinite(s).all():
            raise ValueError(f"streams[{i}]: router logits contain NaN or inf")
    streams = [np.ascontiguousarray(s) for s in streams]
    L, E = streams[0].shape[1:]
    cost = cost or CostModel()
    capacities = [capacity_for(g.fraction, E) for g in grid]
    initials = []
    for g, C in zip(grid, capacities, strict=True):
        check_sizes(E, k, C)
        init = None if initial_sets is None else initial_sets.get(C)
        if initial_sets is not None and init is None:
            raise ValueError(f"initial_sets: no resident set for capacity {C} ({g.name})")
        initials.append(check_initial(init, (L, C), E))
    if lookahead is not None and len(lookahead) != len(streams):
        raise ValueError(
            f"lookahead: need one array per stream ({len(streams)}), got {len(lookahead)}"
        )
    ys: list[np.ndarray | None] = [None] * len(streams)
    table = None
    for g, C in zip(grid, capacities, strict=True):
        for i, s in enumerate(streams):
            y = check_lookahead(g.policy, C, None if lookahead is None else lookahead[i], s.shape)
            ys[i] = y if y is not None else ys[i]
        A = check_coactivation(g.policy, coactivation, (L, E, E))
        table = A if A is not None else table
    # the demand-paging bound of fetch_all; with prefetch (not demand paging) or route_bias (whose
    # selections follow the cache) it bounds nothing, so those rows carry none
    use_belady = [
        belady and g.policy.rule == "fetch_all" and g.policy.prefetch == 0
        and g.policy.route_bias == 0
        for g in grid
    ]  # fmt: skip
    total_T = sum(s.shape[0] for s in streams)
    mass = [np.zeros((total_T, L), np.float64) for _ in grid]
    counters = np.zeros((len(grid), L, len(COUNTER_NAMES)), np.int64)
    belady_hits = np.zeros((len(grid), L), np.int64)
    rerouted = np.zeros((len(grid), L), np.float64)
    _core.simulate_grid(
        streams, ys, k, [g.policy._core_args() for g in grid], capacities, initials, use_belady,
        table, mass, counters, rerouted, belady_hits, n_threads or os.cpu_count() or 1,
    )  # fmt: skip
    rows = []
    for gi, (g, C) in enumerate(zip(grid, capacities, strict=True)):
        for layer in [*range(L), -1]:
            if layer >= 0:
                row = counter_row(g, C, layer, counters[gi, layer], k)
                m = mass[gi][:, layer]
                bel = belady_hits[gi, layer]
                rho = rerouted[gi, layer]
            else:
                row = counter_row(g, C, layer, counters[gi].sum(0), k)
                m = mass[gi].ravel()
                bel = belady_hits[gi].sum()
                rho = rerouted[gi].sum()
            n_layers = L if layer < 0 else 1
            rows.append(
                {
                    **row,
                    "mass_mean": float(m.mean()),
                    "mass_p50": float(np.quantile(m, 0.5)),
                    "mass_p90": float(np.quantile(m, 0.9)),
                    "mass_p99": float(np.quantile(m, 0.99)),
                    "mass_per_token": float(mass[gi].sum(1).mean()) if layer < 0 else None,
                    "rerouted_mean": float(rho) / row["tokens"],
                    "est_time_per_token_s": cost.time_per_token(row, n_layers),
                    "belady_hit_rate": bel / (row["tokens"] * k) if use_belady[gi] else None,
                }
            )
    return pl.DataFrame(rows)
