"""Per-token-layer counts as table columns: what a policy did at every token-layer of a run.

The simulator (`simulate/{policy}/{size}.counts.parquet`) and the engine (its per-token
table) record, per token, the (L, F) counts of `TOKEN_LAYER_FIELDS` (experts hit, fetched,
substituted, computed by the host, force-fetched; prefetched; background copies requested;
admissions landed): the pricing's input (`moesub.pricing`). In a table they are one column,
`token_layer_counts`, a fixed-size list of L x F int16 values per row (layer-major), beside
`stream` and `pos`; `token_layer_fields` in the file's metadata names the fields.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from moesub.vocabulary import TOKEN_LAYER_FIELDS

COLUMN = "token_layer_counts"


def counts_column(counts: np.ndarray) -> pl.Series:
    """(T, L, F) integer counts -> the column (one row per token)."""
    a = np.asarray(counts)
    F = len(TOKEN_LAYER_FIELDS)
    if a.ndim != 3 or a.shape[2] != F:
        raise ValueError(f"{COLUMN}: expected (T, L, {F}) counts, got shape {a.shape}")
    flat = a.reshape(len(a), -1).astype(np.int16)
    return pl.Series(COLUMN, flat, dtype=pl.Array(pl.Int16, flat.shape[1]))


def counts_table(stream: np.ndarray, pos: np.ndarray, counts: np.ndarray) -> pl.DataFrame:
    """`stream, pos, token_layer_counts`: one row per token."""
    return pl.DataFrame(
        {"stream": np.asarray(stream, np.int32), "pos": np.asarray(pos, np.int32)}
    ).with_columns(counts_column(counts))


def stream_counts(df: pl.DataFrame) -> list[np.ndarray]:
    """A table with `stream, pos, token_layer_counts` -> one (T_s, L, F) int32 array per stream
    (streams in increasing id, tokens in position order)."""
    missing = {"stream", "pos", COLUMN} - set(df.columns)
    if missing:
        raise ValueError(f"token-layer counts: the table has no column(s) {sorted(missing)}")
    df = df.sort("stream", "pos")
    width = df.schema[COLUMN].size
    F = len(TOKEN_LAYER_FIELDS)
    if width % F:
        raise ValueError(f"{COLUMN}: {width} values per row is not L x {F}")
    flat = df[COLUMN].to_numpy().reshape(df.height, width // F, F).astype(np.int32)
    bounds = np.flatnonzero(np.diff(df["stream"].to_numpy())) + 1
    return np.split(flat, bounds)
