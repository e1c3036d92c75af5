"""The regime stage: a model's cache regime at one cache fraction, its static skew beside the
real reference model's, and the pinning designs on the evaluation trace and on its skew-matched
twin (`moesub.regime.matched`, `moesub.regime.designs`).

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

from moesub.artefacts import (
    frequency_sets,
    has_lookahead,
    initial_set_for,
    load_trace,
)
from moesub.config import REGIME_FRACTION
from moesub.config.names import number_label
from moesub.grid import GridPoint, simulate
from moesub.io import write_json, write_parquet
from moesub.policy import STUDY_POLICIES, Policy
from moesub.regime.designs import World, designs_of, replay_designs
from moesub.regime.matched import skew_summary, skew_table
from moesub.regime.measure import Regime, trace_regime
from moesub.skew import target_shares
from moesub.skewmatch import skew_match
from moesub.vocabulary import capacity_for


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


def regime_from_captures(
    router_path: str | os.PathLike,
    calib_router_path: str | os.PathLike,
    initial_sets_path: str | os.PathLike,
    fraction: float = REGIME_FRACTION,
    fractions: Sequence[float] = (),
    policies: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int = 0,
) -> RegimeRun:
    """The regime of the evaluation capture at `fraction` (caches starting from the initial
    sets), its skew columns (coverage also at each of `fractions`) and the designs among
    `policies` at each of `fractions` in both worlds; `seed`: the skew match's."""
    designs = designs_of(policies or {})  # bad pins fail before any work
    trace = load_trace(router_path, lookahead=has_lookahead(router_path))
    E, k, L = trace.num_experts, trace.top_k, trace.num_layers
    regime = trace_regime(trace, initial_sets_path, fraction)
    capacity = regime.summary["capacity"]
    initial = initial_set_for(initial_sets_path, fraction, L, E, capacity)

    prefetch = any(int(spec.get("prefetch", 0)) > 0 for spec in designs.values())
    calib = load_trace(calib_router_path, lookahead=prefetch and has_lookahead(calib_router_path))
    shares = target_shares(L, E)
    matched = skew_match(trace.logits, k, shares, seed, trace.lookahead)
    matched_calib = skew_match(calib.logits, k, shares, seed + 1, calib.lookahead)
    matched_ranking = frequency_sets(matched_calib.counts, E)  # (L, E), hottest first
    matched_initial = matched_ranking[:, :capacity]
    matched_hits = fetch_every_miss_hit_rates(matched.logits, k, capacity, matched_initial)
    sizes = {f"f{number_label(f)}": capacity_for(f, E) for f in fractions}
    table = skew_table(
        matched.stream_counts.sum(axis=0), matched.counts, matched.stream_counts, shares,
        initial, matched_initial, matched_hits, sizes,
    )  # fmt: skip
    layers = regime.layers.join(table, on="layer", how="left", maintain_order="left")
    skew = skew_summary(table, regime.summary["hit_rate"], capacity, E)
    summary = {**regime.summary, "skew": {**skew, "seed": seed}}

    worlds = [
        World("evaluation", trace.logits, trace.lookahead,
              lambda f: initial_set_for(initial_sets_path, f, L, E, capacity_for(f, E))),
        World("skew_matched", matched.logits, matched.lookahead,
              lambda f: matched_ranking[:, : capacity_for(f, E)]),
    ]  # fmt: skip
    rows = [replay_designs(w, k, designs, fractions) for w in worlds] if designs else []
    return RegimeRun(Regime(layers, summary), pl.concat(rows) if rows else pl.DataFrame())


def run_regime(
    router_path: str,
    calib_router_path: str,
    initial_sets_path: str,
    fraction: float,
    out_table: str | os.PathLike,
    out_summary: str | os.PathLike,
    out_designs: str | os.PathLike,
    fractions: Sequence[float] = (),
    policies: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int = 0,
) -> None:
    """Snakemake entry point: `regime_from_captures`, then the three artefacts (module docs)."""
    run = regime_from_captures(
        router_path, calib_router_path, initial_sets_path, fraction, fractions, policies, seed
    )
    write_parquet(run.regime.layers, out_table, metadata={"summary": run.regime.summary})
    write_json(run.regime.summary, Path(out_summary))
    write_parquet(run.designs, out_designs, metadata={"seed": seed})
