"""The regime stage: a model's cache regime at one cache size, its static skew beside the real
reference model's, and the pinning and allocation designs on the evaluation trace and on its
skew-matched twin (`moesub.regime.matched`, `moesub.regime.designs`).

Entry point: `run_regime` writes `regime.parquet` (per layer the regime and skew columns, the
summary as metadata), `regime.json` (the summary: headline figures, references, verdict, the
`skew` entry) and `regime_designs.parquet` (`moesub.regime.designs.replay_designs` rows of both
worlds, with a `world` column; no rows without designs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesub.allocation import plan
from moesub.artefacts import frequency_sets, has_lookahead, load_trace, read_expert_ranking
from moesub.config.policies import is_planned
from moesub.grid import GridPoint, simulate
from moesub.io import write_json, write_parquet
from moesub.layout import read_allocation
from moesub.policy import STUDY_POLICIES, Policy
from moesub.regime.designs import World, designs_of, replay_designs
from moesub.regime.matched import skew_summary, skew_table
from moesub.regime.measure import Regime, trace_regime
from moesub.skew import target_shares
from moesub.skewmatch import skew_match
from moesub.slots import CacheSize

Size = float | Mapping[str, Any] | CacheSize


@dataclass(frozen=True)
class RegimeRun:
    """The stage's results: `regime` (layers with the skew columns, summary with `skew`) and
    `designs` (one row per world, design, role and size; empty without designs)."""

    regime: Regime
    designs: pl.DataFrame


def fetch_every_miss_hit_rates(
    streams: list[np.ndarray], k: int, capacity: int, initial: np.ndarray
) -> np.ndarray:
    """(L + 1,) `fetch_every_miss` hit rates per layer, then pooled, from an (L, C) start."""
    policy = Policy.from_dict(STUDY_POLICIES["fetch_every_miss"])
    sim = simulate(streams, k, [GridPoint("fem", policy, capacity, initial)], belady=False)
    rates = dict(zip(sim["layer"].to_list(), sim["hit_rate"].to_list(), strict=True))
    return np.array([rates[layer] for layer in [*range(len(initial)), -1]])


def _check_allocations(
    designs: Mapping[str, Mapping[str, Any]],
    sizes: Sequence[CacheSize],
    allocations: Mapping[str, Mapping[str, str | os.PathLike]],
) -> None:
    """Every planned design has an allocation artefact at every size (before any work)."""
    for name, spec in designs.items():
        missing = [s.label for s in sizes if s.label not in allocations.get(name, {})]
        if is_planned(spec) and missing:
            raise ValueError(
                f"design {name!r} is planned (allocation: planned) but has no allocation "
                f"artefact at sizes {missing} (allocations[{name!r}][<size label>])"
            )


def regime_from_captures(
    router_path: str | os.PathLike,
    calib_router_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    size: Size,
    sizes: Sequence[Size] = (),
    policies: Mapping[str, Mapping[str, Any]] | None = None,
    allocations: Mapping[str, Mapping[str, str | os.PathLike]] | None = None,
    seed: int = 0,
) -> RegimeRun:
    """The regime of the evaluation capture at `size` (caches starting from the expert ranking
    at `ranking_path`), its skew columns (coverage also at each of `sizes`) and the designs
    among `policies` at each of `sizes` in both worlds; `allocations`: design -> size label ->
    its allocation artefact, for each planned design; `seed`: the skew match's."""
    designs = designs_of(policies or {})  # bad pins fail before any work
    allocations = allocations or {}
    trace = load_trace(router_path, lookahead=has_lookahead(router_path))
    E, k, L = trace.num_experts, trace.top_k, trace.num_layers
    sizes = [CacheSize.of(s, E) for s in sizes]
    _check_allocations(designs, sizes, allocations)
    regime = trace_regime(trace, ranking_path, size)
    capacity = regime.summary["capacity"]
    ranking = read_expert_ranking(ranking_path, L, E)  # (L, E), hottest first

    prefetch = any(int(spec.get("prefetch", 0)) > 0 for spec in designs.values())
    calib = load_trace(calib_router_path, lookahead=prefetch and has_lookahead(calib_router_path))
    shares = target_shares(L, E)
    matched = skew_match(trace.logits, k, shares, seed, trace.lookahead)
    matched_calib = skew_match(calib.logits, k, shares, seed + 1, calib.lookahead)
    matched_ranking = frequency_sets(matched_calib.counts, E)  # (L, E), hottest first
    matched_hits = fetch_every_miss_hit_rates(
        matched.logits, k, capacity, matched_ranking[:, :capacity]
    )
    table = skew_table(
        matched.stream_counts.sum(axis=0), matched.counts, matched.stream_counts, shares,
        ranking[:, :capacity], matched_ranking[:, :capacity], matched_hits,
        {s.label: s.capacity for s in sizes},
    )  # fmt: skip
    layers = regime.layers.join(table, on="layer", how="left", maintain_order="left")
    skew = skew_summary(table, regime.summary["hit_rate"], capacity, E)
    summary = {**regime.summary, "skew": {**skew, "seed": seed}}

    def planned_here(name: str, s: CacheSize) -> tuple[int, ...]:
        return read_allocation(allocations[name][s.label], L, s.capacity)

    def planned_matched(name: str, s: CacheSize) -> tuple[int, ...]:
        return plan(matched_calib.logits, k, matched_ranking, designs[name], s,
                    matched_calib.lookahead)[2]  # fmt: skip

    worlds = [
        World("evaluation", trace.logits, trace.lookahead, ranking, planned_here),
        World("skew_matched", matched.logits, matched.lookahead, matched_ranking, planned_matched),
    ]
    rows = [replay_designs(w, k, designs, sizes) for w in worlds] if designs else []
    return RegimeRun(Regime(layers, summary), pl.concat(rows) if rows else pl.DataFrame())


def run_regime(
    router_path: str,
    calib_router_path: str,
    ranking_path: str,
    size: Size,
    out_table: str | os.PathLike,
    out_summary: str | os.PathLike,
    out_designs: str | os.PathLike,
    sizes: Sequence[Size] = (),
    policies: Mapping[str, Mapping[str, Any]] | None = None,
    allocations: Mapping[str, Mapping[str, str | os.PathLike]] | None = None,
    seed: int = 0,
) -> None:
    """Snakemake entry point: `regime_from_captures`, then the three artefacts (module docs)."""
    run = regime_from_captures(
        router_path, calib_router_path, ranking_path, size, sizes, policies, allocations, seed
    )
    write_parquet(run.regime.layers, out_table, metadata={"summary": run.regime.summary})
    write_json(run.regime.summary, Path(out_summary))
    write_parquet(run.designs, out_designs, metadata={"seed": seed})
