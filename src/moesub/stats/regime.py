"""Regime: each model's cache regime (the regime artefact) into the analysis outputs.

`regime.parquet` gets the model's per-layer regime figures as (layer, metric, value, reference,
trace_study_reference) rows; `analysis.json` gets the headline figures and the one-line verdict.
The reference figures are the ones the regime artefact's summary records.

Entry point: `regime(paths) -> Regime`.
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
)


class Regime(NamedTuple):
    """`table`: the per-layer figures as (layer, metric, value, reference,
    trace_study_reference) rows; `result`: the headline figures and the verdict
    (`analysis.json["regime"]`, None when missing); `status`."""

    table: pd.DataFrame
    result: dict[str, Any] | None
    status: dict[str, Any]


def regime(paths: list[str]) -> Regime:
    """The model's regime table (`paths`: its one regime.parquet, or none)."""
    if not paths:
        return Regime(pl.DataFrame().to_pandas(), None, missing("no regime artefact"))
    if len(paths) > 1:
        raise ValueError(f"inputs['regime']: one regime table per model, got {paths}")
    summary = read_metadata(paths[0]).get("summary")
    if not summary:
        raise ValueError(f"inputs['regime']: {paths[0]!r} has no 'summary' metadata")
    references = summary.get("references")
    if not references:
        raise ValueError(f"inputs['regime']: {paths[0]!r}: the summary records no references")
    table = long_table(pl.read_parquet(paths[0]), references).to_pandas()
    result = {**{key: summary.get(key) for key in HEADLINE_KEYS}, "references": references}
    return Regime(table, result, {"status": "ok"})


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
