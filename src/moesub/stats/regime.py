"""Regime: each model's cache regime (moesub.regime) into the analysis outputs.

`regime.parquet` gets the model's per-layer regime figures as (layer, metric, value, reference,
trace_study_reference) rows; `analysis.json` gets the headline figures and the one-line verdict.

Entry point: `regime_part(ctx)`.
"""

from __future__ import annotations

import polars as pl

from moesub.io import read_metadata
from moesub.regime import REFERENCES, long_table
from moesub.stats.load import Context, missing

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
    "verdict",
)


def regime_part(ctx: Context) -> None:
    paths = ctx.inputs.get("regime", [])
    if not paths:
        ctx.tables["regime"] = pl.DataFrame().to_pandas()
        ctx.parts["regime"] = missing("no regime artefact")
        return
    if len(paths) > 1:
        raise ValueError(f"inputs['regime']: one regime table per model, got {paths}")
    summary = read_metadata(paths[0]).get("summary")
    if not summary:
        raise ValueError(f"inputs['regime']: {paths[0]!r} has no 'summary' metadata")
    ctx.tables["regime"] = long_table(pl.read_parquet(paths[0])).to_pandas()
    ctx.results["regime"] = {
        **{key: summary.get(key) for key in HEADLINE_KEYS},
        "references": {name: {"value": v, "source": s} for name, (v, s) in REFERENCES.items()},
    }
    ctx.parts["regime"] = {"status": "ok"}
