"""Grid replay: router-logit streams through a grid of policies x caches.

The replay itself is the C++ policy core (`_core.simulate_grid`, threads over grid points and
layers); `replay` checks the streams and the grid and returns the core's raw counts (per layer,
and on request per token-layer: `Replay.token_counts`, the pricing's input); `simulate` turns
them into the replay table: rates, mass quantiles, the Belady bound. Time is the pricing's
(`moesub.pricing`, from the per-token-layer counts under a hardware profile), not the table's.
The simulate stage (`moesub.simulate`) and the regime measurement
(`moesub.regime`) both replay through it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moesub import _core
from moesub.policy import (
    STATUS_NAMES,
    TOKEN_LAYER_DTYPE,
    TOKEN_LAYER_FIELDS,
    Layers,
    Policy,
    capacity_for,
    check_coactivation,
    check_layers,
    check_lookahead,
)

# The core's counters in its order (csrc/policy.hpp `Counters`): one per status code between the
# token count and the cache's own events.
COUNTER_NAMES = (
    "tokens", *STATUS_NAMES, "admission_requests", "admissions", "evictions", "prefetches"
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class GridPoint:
    """One point of the grid: a named policy with its cache, per layer (`moesub.policy.scan`'s
    `capacity` and `initial`; the policy's pin counts from the front of each initial set)."""

    name: str
    policy: Policy
    capacity: int | tuple[int, ...]  # C in every layer, or C_l per layer
    initial: np.ndarray | Sequence[np.ndarray] | None = None  # (L, C), L sets of C_l, None: 0..
    # the cache fraction the point stands for (the table's `fraction`); None: the share of
    # experts resident, sum C_l / (L E)
    fraction: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.capacity, Sequence):  # frozen: set through object
            object.__setattr__(self, "capacity", tuple(self.capacity))

    @classmethod
    def at_fraction(
        cls,
        name: str,
        policy: Policy,
        fraction: float,
        num_experts: int,
        initial: np.ndarray | Sequence[np.ndarray] | None = None,
    ) -> GridPoint:
        """A cache of C = capacity_for(fraction, E) slots in every layer."""
        return cls(name, policy, capacity_for(fraction, num_experts), initial, fraction)


def counter_row(
    point: GridPoint, fraction: float, capacity: int | None, layer: int, counts: np.ndarray, k: int
) -> dict[str, Any]:
    """A replay table row's leading columns: the grid point, the layer (-1: all layers), the
    core's counters (`counts` in COUNTER_NAMES order) and the hit and substitution rates."""
    c = dict(zip(COUNTER_NAMES, counts.tolist(), strict=True))
    calls = c["tokens"] * k
    return {
        "policy": point.name,
        "fraction": fraction,
        "capacity": capacity,
        "layer": layer,
        **c,
        "hit_rate": c["hit"] / calls,
        "sub_rate": c["sub"] / calls,
    }


def row_capacities(capacities: tuple[int, ...]) -> list[int | None]:
    """The table's `capacity` per layer, then on the total row: the slots per layer when that
    is one number (every C_l equal, or their mean an integer), else null."""
    total, L = sum(capacities), len(capacities)
    return [*capacities, total // L if total % L == 0 else None]


def table_fraction(point: GridPoint, capacities: tuple[int, ...], num_experts: int) -> float:
    """The table's `fraction` of a point: the one it stands for, else the share resident."""
    if point.fraction is not None:
        return point.fraction
    return sum(capacities) / (len(capacities) * num_experts)


def check_grid_point(g: GridPoint, k: int, num_layers: int, num_experts: int) -> Layers:
    """A grid point's per-layer caches (`moesub.policy.check_layers`); errors name the point."""
    try:
        return check_layers(g.policy, k, g.capacity, g.initial, num_layers, num_experts)
    except ValueError as e:
        raise ValueError(f"grid point {g.name!r}: {e}") from None


@dataclass(frozen=True)
class Replay:
    """What `replay` measured, per grid point g (grid order) and layer l."""

    grid: list[GridPoint]
    layers: list[Layers]  # each point's checked caches
    num_experts: int
    k: int
    stream_lengths: tuple[int, ...]
    counters: np.ndarray  # int64 (G, L, len(COUNTER_NAMES))
    mass: list[np.ndarray]  # per point float64 (sum of T, L): substituted mass per token-layer
    rerouted: np.ndarray  # float64 (G, L): rerouted mass, summed over tokens
    belady_hits: np.ndarray  # int64 (G, L): the optimal-eviction bound's hits (has_belady only)
    has_belady: list[bool]
    # per point int16 (sum of T, L, len(TOKEN_LAYER_FIELDS)), streams in order; None unless
    # asked for
    token_counts: list[np.ndarray] | None

    def stream_counts(self, g: int) -> list[np.ndarray]:
        """Point g's token-layer counts, one (T_i, L, F) array per stream (pricing's input)."""
        if self.token_counts is None:
            raise ValueError("token counts: replay(..., token_counts=True) records them")
        return np.split(self.token_counts[g], np.cumsum(self.stream_lengths)[:-1])

    def table(self) -> pl.DataFrame:
        """One row per grid point and layer, plus a total row per grid point (layer = -1)."""
        k, L = self.k, self.counters.shape[1]
        rows = []
        for gi, (g, layers) in enumerate(zip(self.grid, self.layers, strict=True)):
            fraction = table_fraction(g, layers.capacities, self.num_experts)
            capacities = row_capacities(layers.capacities)
            for layer, capacity in zip([*range(L), -1], capacities, strict=True):
                if layer >= 0:
                    counts, m = self.counters[gi, layer], self.mass[gi][:, layer]
                    bel, rho = self.belady_hits[gi, layer], self.rerouted[gi, layer]
                else:
                    counts, m = self.counters[gi].sum(0), self.mass[gi].ravel()
                    bel, rho = self.belady_hits[gi].sum(), self.rerouted[gi].sum()
                row = counter_row(g, fraction, capacity, layer, counts, k)
                per_token = float(self.mass[gi].sum(1).mean()) if layer < 0 else None
                rows.append(
                    {
                        **row,
                        "mass_mean": float(m.mean()),
                        "mass_p50": float(np.quantile(m, 0.5)),
                        "mass_p90": float(np.quantile(m, 0.9)),
                        "mass_p99": float(np.quantile(m, 0.99)),
                        "mass_per_token": per_token,
                        "rerouted_mean": float(rho) / row["tokens"],
                        "belady_hit_rate": bel / (row["tokens"] * k)
                        if self.has_belady[gi]
                        else None,
                    }
                )
        return pl.DataFrame(rows)


def check_streams(streams: list[np.ndarray]) -> list[np.ndarray]:
    """Router-logit streams of one model: float32 (T, L, E) each, finite; contiguous."""
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
    return [np.ascontiguousarray(s) for s in streams]


def replay(
    streams: list[np.ndarray],
    k: int,
    grid: list[GridPoint],
    n_threads: int | None = None,
    belady: bool = True,
    lookahead: list[np.ndarray] | None = None,
    coactivation: np.ndarray | None = None,
    token_counts: bool = False,
) -> Replay:
    """Replay every stream (float32 (T, L, E); caches restart per stream) for every grid point.

    `lookahead` holds each stream's lookahead logits (prefetch), `coactivation` the (L, E, E)
    table (substitute_by='coactivation'); see moesub.policy.scan. `belady`: also the optimal
    eviction's hits for the fetch_all points (the demand-paging bound). `token_counts`: also
    each token-layer's counts (`Replay.token_counts`, TOKEN_LAYER_FIELDS).
    """
    streams = check_streams(streams)
    L, E = streams[0].shape[1:]
    if not grid:
        raise ValueError("grid: need at least one grid point")
    layers = [check_grid_point(g, k, L, E) for g in grid]
    if lookahead is not None and len(lookahead) != len(streams):
        raise ValueError(
            f"lookahead: need one array per stream ({len(streams)}), got {len(lookahead)}"
        )
    ys: list[np.ndarray | None] = [None] * len(streams)
    table = None
    for g in grid:
        for i, s in enumerate(streams):
            y = check_lookahead(g.policy, None if lookahead is None else lookahead[i], s.shape)
            ys[i] = y if y is not None else ys[i]
        A = check_coactivation(g.policy, coactivation, (L, E, E))
        table = A if A is not None else table
    largest = np.iinfo(TOKEN_LAYER_DTYPE).max  # a count is at most E
    if token_counts and largest < E:
        raise ValueError(f"token counts: E={E} experts may not fit {TOKEN_LAYER_DTYPE.__name__}")
    # the demand-paging bound of fetch_all (a pinned cache's too: pinning only restricts it);
    # with prefetch (not demand paging) or route_bias (whose selections follow the cache) it
    # bounds nothing, so those rows carry none
    has_belady = [
        belady and g.policy.rule == "fetch_all" and g.policy.prefetch == 0
        and g.policy.route_bias == 0
        for g in grid
    ]  # fmt: skip
    lengths = tuple(s.shape[0] for s in streams)
    G, F = len(grid), len(TOKEN_LAYER_FIELDS)
    mass = [np.zeros((sum(lengths), L), np.float64) for _ in grid]
    counts = (
        [np.zeros((sum(lengths), L, F), TOKEN_LAYER_DTYPE) for _ in grid] if token_counts else None
    )
    counters = np.zeros((G, L, len(COUNTER_NAMES)), np.int64)
    belady_hits = np.zeros((G, L), np.int64)
    rerouted = np.zeros((G, L), np.float64)
    _core.simulate_grid(
        streams, ys, k, [g.policy._core_args() for g in grid],
        [x.capacities for x in layers], [x.pins for x in layers], [x.initials for x in layers],
        has_belady, table, mass, counts or [None] * G, counters, rerouted, belady_hits,
        n_threads or os.cpu_count() or 1,
    )  # fmt: skip
    return Replay(
        grid, layers, E, k, lengths, counters, mass, rerouted, belady_hits, has_belady, counts
    )


def simulate(
    streams: list[np.ndarray],
    k: int,
    grid: list[GridPoint],
    n_threads: int | None = None,
    belady: bool = True,
    lookahead: list[np.ndarray] | None = None,
    coactivation: np.ndarray | None = None,
) -> pl.DataFrame:
    """`replay` as its table (`Replay.table`): one row per grid point and layer, plus a total
    row per grid point (layer = -1)."""
    return replay(streams, k, grid, n_threads, belady, lookahead, coactivation).table()
