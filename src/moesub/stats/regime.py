"""Regime: each model's cache regime (the regime artefacts) into the analysis outputs.

`regime.parquet` gets the model's per-layer regime figures as (layer, metric, value, reference,
trace_study_reference) rows (the static-skew measures beside the real model's among them);
`analysis.json` gets the headline figures, the one-line verdict and the skew line. The reference
figures are the ones the regime artefact's summary records.

`regime_designs.parquet` sets each pinning or allocation design beside its counterpart on the
evaluation trace and on the skew-matched trace (`design_comparison`): per (design, size) and
trace the hit rates and misses per token of both, the design's gain, and how the gain changes
under the real model's skew (``gain_change``).

Entry point: `regime(paths, design_paths) -> Regime`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd
import polars as pl

from moesub.io import read_metadata
from moesub.stats.load import missing

HEADLINE_KEYS = (
    "fraction",
    "capacity",
    "tokens",
    "hit_rate",
    "belady_hit_rate",
    "rule015_sub_rate",
    "heavy_lower_ranks",
    "min_effective_experts",
    "collapsed",
    "lookahead_recall_k",
    "lookahead_recall_2k",
    "verdict",
    "skew",
)
WORLDS = ("evaluation", "skew_matched")  # the traces the regime's designs replay on
DESIGN_NEEDS = (
    "world", "design", "role", "change", "counterpart", "size", "capacity", "capacities", "pins",
    "hit_rate", "misses_per_token", "fetches_per_token",
)  # fmt: skip


class Regime(NamedTuple):
    """`table`: the per-layer figures as (layer, metric, value, reference,
    trace_study_reference) rows; `designs`: `design_comparison` (empty without designs);
    `result`: the headline figures and the verdict (`analysis.json["regime"]`, None when
    missing); `status`."""

    table: pd.DataFrame
    designs: pd.DataFrame
    result: dict[str, Any] | None
    status: dict[str, Any]


def regime(paths: list[str], design_paths: list[str]) -> Regime:
    """The model's regime table (`paths`: its one regime.parquet, or none) and its designs
    beside their counterparts on both traces (`design_paths`: its regime_designs.parquet)."""
    if not paths:
        empty = pl.DataFrame().to_pandas()
        return Regime(empty, empty, None, missing("no regime artefact"))
    if len(paths) > 1 or len(design_paths) > 1:
        raise ValueError(f"inputs['regime']: one regime table per model, got {paths}")
    summary = read_metadata(paths[0]).get("summary")
    if not summary:
        raise ValueError(f"inputs['regime']: {paths[0]!r} has no 'summary' metadata")
    references = summary.get("references")
    if not references:
        raise ValueError(f"inputs['regime']: {paths[0]!r}: the summary records no references")
    table = long_table(pl.read_parquet(paths[0]), references).to_pandas()
    result = {**{key: summary.get(key) for key in HEADLINE_KEYS}, "references": references}
    designs = pl.read_parquet(design_paths[0]) if design_paths else pl.DataFrame()
    lacking = [c for c in DESIGN_NEEDS if c not in designs.columns]
    if not designs.is_empty() and lacking:
        raise ValueError(f"inputs['regime_designs']: {design_paths[0]!r} lacks columns {lacking}")
    comparison = design_comparison(designs) if not designs.is_empty() else designs
    return Regime(table, comparison.to_pandas(), result, {"status": "ok"})


def design_comparison(designs: pl.DataFrame) -> pl.DataFrame:
    """One row per (design, size): on each trace w (`WORLDS`) the design's and its
    counterpart's hit rate and misses per token (`hit_rate_<w>`, `counterpart_hit_rate_<w>`,
    ...), the design's gain in hit rate (`gain_<w>`) and change in misses per token
    (`miss_change_<w>`), the per-layer slots; `gain_change`: the gain under the real model's
    skew minus the gain on the evaluation trace."""
    keys = ["design", "change", "counterpart", "size", "capacity"]
    measures = ["hit_rate", "misses_per_token", "fetches_per_token", "capacities", "pins"]
    wide = None
    for world in WORLDS:
        for role, prefix in (("design", ""), ("counterpart", "counterpart_")):
            part = designs.filter((pl.col("world") == world) & (pl.col("role") == role)).select(
                *keys, *[pl.col(m).alias(f"{prefix}{m}_{world}") for m in measures]
            )
            wide = part if wide is None else wide.join(part, on=keys, how="full", coalesce=True)
    assert wide is not None
    return (
        wide.with_columns(
            *[
                (pl.col(f"hit_rate_{w}") - pl.col(f"counterpart_hit_rate_{w}")).alias(f"gain_{w}")
                for w in WORLDS
            ],
            *[
                (
                    pl.col(f"misses_per_token_{w}") - pl.col(f"counterpart_misses_per_token_{w}")
                ).alias(f"miss_change_{w}")
                for w in WORLDS
            ],
        )
        .with_columns(
            (pl.col("gain_skew_matched") - pl.col("gain_evaluation")).alias("gain_change")
        )
        .sort("design", "capacity")
    )


def long_table(layers: pl.DataFrame, references: dict[str, dict]) -> pl.DataFrame:
    """The per-layer table as (layer, metric, value, reference, trace_study_reference) rows.

    ``reference`` is the study's figure for the metric (all layers only; null where it gives
    none), ``trace_study_reference`` the llama.cpp trace study's (hit rate only); `references`
    is the regime summary's `{name: {"value", "source"}}`.
    """
    metrics = [c for c in layers.columns if c not in ("layer", "tokens", "capacity")]
    long = layers.select(pl.col("layer").cast(pl.Int64), pl.col(metrics).cast(pl.Float64))
    long = long.unpivot(index="layer", on=metrics, variable_name="metric", value_name="value")
    study = {m: r["value"] for m, r in references.items() if m in metrics}
    trace = {"hit_rate": references["hit_rate_llamacpp"]["value"]}
    total = pl.col("layer") == -1
    return long.with_columns(
        pl.when(total)
        .then(pl.col("metric").replace_strict(study, default=None, return_dtype=pl.Float64))
        .alias("reference"),
        pl.when(total)
        .then(pl.col("metric").replace_strict(trace, default=None, return_dtype=pl.Float64))
        .alias("trace_study_reference"),
    )
