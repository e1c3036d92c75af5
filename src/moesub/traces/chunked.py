"""Grid simulation of a trace in token chunks, through one streaming `LayerCache` per (grid
point, layer): memory is bounded by the chunk, not the trace, and the counts are exactly those
of a whole-stream `scan` (or `moesub.grid.simulate`, belady bound apart) of the same streams.

A trace of ids only (MBLT, expert logs) is fed as `rank_logits`, so only policies that never
read a weight or a non-selected logit run on it (`logits_needed`). Prefetch needs lookahead
logits, which no trace file records; belady needs the whole future.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import polars as pl

from moesub.grid import (
    COUNTER_NAMES,
    GridPoint,
    check_grid_point,
    counter_row,
    row_capacities,
    table_fraction,
)
from moesub.policy import OFFLINE_EVICTIONS, STATUS_NAMES, LayerCache, Layers
from moesub.traces.base import TraceChunk, logits_needed, rank_logits


class TraceSource(Protocol):
    """What `simulate_trace` reads: a `RouterTrace` or an `Rtrace01File`."""

    num_experts: int
    top_k: int
    format: str

    @property
    def num_layers(self) -> int: ...

    @property
    def has_logits(self) -> bool: ...

    def chunks(self, chunk_tokens: int): ...


def check_grid(source: TraceSource, grid: list[GridPoint]) -> None:
    """Each grid point runs on this source: a ValueError naming the point and what it lacks."""
    for g in grid:
        if g.policy.prefetch > 0:
            raise ValueError(
                f"grid point {g.name!r}: prefetch reads lookahead logits, which a trace file "
                "does not record"
            )
        if g.policy.eviction in OFFLINE_EVICTIONS:
            raise ValueError(
                f"grid point {g.name!r}: eviction {g.policy.eviction!r} needs the whole future; "
                "the chunked simulation is online"
            )
        why = None if source.has_logits else logits_needed(g.policy)
        if why:
            raise ValueError(
                f"grid point {g.name!r}: the {source.format} trace holds expert ids only, and {why}"
            )


def simulate_trace(
    source: TraceSource,
    grid: list[GridPoint],
    chunk_tokens: int = 1024,
    n_threads: int | None = None,
) -> pl.DataFrame:
    """Replay `source` chunk by chunk for every grid point (caches restart per stream).

    Each grid point carries its per-layer capacities and initial sets (`moesub.grid.GridPoint`).
    Returns one row per grid point and layer plus a total row (layer = -1): the core's
    counters (`moesub.grid.COUNTER_NAMES`), hit_rate, sub_rate and mass_mean (substituted
    mass per token-layer).
    """
    if not grid:
        raise ValueError("grid: need at least one grid point")
    check_grid(source, grid)
    E, k, L = source.num_experts, source.top_k, source.num_layers
    layers = [check_grid_point(g, k, L, E) for g in grid]
    counters = np.zeros((len(grid), L, len(COUNTER_NAMES)), np.int64)
    col = {name: i for i, name in enumerate(COUNTER_NAMES)}
    mass = np.zeros((len(grid), L), np.float64)
    caches: list[list[LayerCache]] = []

    def retire() -> None:  # a stream ends: its caches' own counters join the totals
        for gi, row in enumerate(caches):
            for l, cache in enumerate(row):
                c = cache.counters()
                counters[gi, l, col["admissions"]] += c["admissions"]
                counters[gi, l, col["evictions"]] += c["evictions"]

    def step(gi: int, l: int, rows: np.ndarray) -> None:
        s = caches[gi][l].step(rows)
        status = np.bincount(s.status.reshape(-1), minlength=len(STATUS_NAMES))
        for code, name in enumerate(STATUS_NAMES):
            counters[gi, l, col[name]] += status[code]
        counters[gi, l, col["tokens"]] += rows.shape[0]
        counters[gi, l, col["admission_requests"]] += len(s.admissions)
        counters[gi, l, col["prefetches"]] += int(s.prefetched.sum())
        mass[gi, l] += s.mass.sum()

    threads = max(1, n_threads or os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        chunk: TraceChunk
        for chunk in source.chunks(chunk_tokens):
            if chunk.stream_start:
                retire()
                caches = [
                    [
                        LayerCache(E, k, x.capacities[l], g.policy.for_layer(l), x.initials[l])
                        for l in range(L)
                    ]
                    for g, x in zip(grid, layers, strict=True)
                ]
            rows = chunk.logits if chunk.logits is not None else rank_logits(chunk.ids, E)
            jobs = [pool.submit(step, gi, l, rows[l]) for gi in range(len(grid)) for l in range(L)]
            for job in jobs:
                job.result()
        retire()
    return _table(grid, layers, counters, mass, k, E)


def _table(
    grid: list[GridPoint],
    layers: list[Layers],
    counters: np.ndarray,
    mass: np.ndarray,
    k: int,
    num_experts: int,
) -> pl.DataFrame:
    rows = []
    for gi, (g, x) in enumerate(zip(grid, layers, strict=True)):
        fraction = table_fraction(g, x.capacities, num_experts)
        layer_ids = [*range(counters.shape[1]), -1]
        for layer, C in zip(layer_ids, row_capacities(x.capacities), strict=True):
            total = layer < 0
            counts = counters[gi].sum(0) if total else counters[gi, layer]
            row = counter_row(g, fraction, C, layer, counts, k)
            m = mass[gi].sum() if total else mass[gi, layer]
            rows.append({**row, "mass_mean": float(m) / row["tokens"]})
    return pl.DataFrame(rows)
