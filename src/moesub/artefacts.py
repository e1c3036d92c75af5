"""The artefacts stages hand to each other: their schemas, readers and writers, in one place.

- **streams** (`streams/{eval,calib}.parquet`, STREAM_SCHEMA): one row per (stream, pos) token;
  every stream holds positions 0..T-1 exactly once. `read_streams` reads and checks one.
- **token table** (`capture/*_tokens.parquet`): the streams plus the exact model's `nll`, with
  the capture's geometry and `batch_tokens` in its metadata. `check_token_table` checks one
  against a model's vocabulary; `iter_streams` walks it stream by stream.
- **router trace** (`capture/*_router.parquet`, `router_schema`): one row per (stream, pos,
  layer) with the E router logits (float32) and, since policy v2, the E lookahead logits
  (`lookahead`, float32: the layer's router one MoE layer earlier, `moesub.models.RouterHook`;
  traces captured before have no such column and still load for v1 policies).
  `router_writer` / `router_rows` write one, `load_trace` reads it back as a `Trace`.
- **expert ranking** (`expert_ranking.parquet`, RANKING_COLUMNS): per MoE layer every expert in
  the order of its selections on the calibration capture (most selected first, ties to the
  lower id: `frequency_sets`), with its count. Every cache's initial experts are a prefix of
  its layer's ranking (`moesub.layout`); `write_expert_ranking` writes it,
  `read_expert_ranking` reads it back and `layout_for` resolves a stage's layout from it.

Per-token decision counts are named by `moesub.policy.STATUS_NAMES` (the core's status codes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from moesub.io import ParquetStreamWriter, read_metadata, write_parquet
from moesub.layout import CacheLayout, build_layout, check_ranking, read_allocation
from moesub.slots import CacheSize
from moesub.vocabulary import Policy

# --------------------------------------------------------------------------------------------
# streams and token tables

STREAM_SCHEMA = pa.schema(
    [
        ("stream", pa.int32()),
        ("pos", pa.int32()),
        ("token_id", pa.int32()),
        ("doc_id", pa.int32()),
        ("doc_start", pa.bool_()),
    ]
)
STREAM_COLUMNS = tuple(STREAM_SCHEMA.names)


def read_streams(path: str | os.PathLike) -> tuple[pa.Table, dict[str, Any]]:
    """Read and validate a streams Parquet file; rows sorted by (stream, pos).

    Each stream must hold positions 0..T-1 exactly once. Returns (table, metadata).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"streams file {str(path)!r} does not exist")
    schema = pq.read_schema(path)
    missing = [c for c in STREAM_COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"streams file {str(path)!r}: missing column(s) {missing}")
    table = pq.read_table(path, columns=list(STREAM_COLUMNS))
    for c in STREAM_COLUMNS:
        if table.column(c).null_count:
            raise ValueError(f"streams file {str(path)!r}: column {c!r} has nulls")
    try:
        table = table.cast(STREAM_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"streams file {str(path)!r}: bad column types: {e}") from e
    if table.num_rows == 0:
        raise ValueError(f"streams file {str(path)!r} has no rows")
    stream = table.column("stream").to_numpy()
    pos = table.column("pos").to_numpy()
    order = np.lexsort((pos, stream))
    if not np.array_equal(order, np.arange(len(order))):
        table = table.take(pa.array(order))
        stream, pos = stream[order], pos[order]
    starts = np.flatnonzero(np.r_[True, stream[1:] != stream[:-1]])
    expected = np.arange(len(pos)) - np.repeat(starts, np.diff(np.r_[starts, len(pos)]))
    if not np.array_equal(pos, expected):
        bad = int(np.flatnonzero(pos != expected)[0])
        raise ValueError(
            f"streams file {str(path)!r}: stream {int(stream[bad])} does not hold positions "
            f"0..T-1 exactly once (row {bad}: pos {int(pos[bad])}, expected {int(expected[bad])})"
        )
    return table, read_metadata(path)


def check_token_table(table: Any, vocab_size: int) -> pl.DataFrame:
    """The token table as polars, sorted by (stream, pos), checked against the model's vocab."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    if not isinstance(df, pl.DataFrame):
        raise ValueError("token table must be a table (polars / pyarrow), not a single column")
    missing = [c for c in STREAM_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"token table lacks column(s) {missing}; has {df.columns}")
    if df.height == 0:
        raise ValueError("token table is empty")
    df = df.sort("stream", "pos")
    lo, hi = df["token_id"].min(), df["token_id"].max()
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"token table holds token ids in [{lo}, {hi}] but the model's vocabulary has "
            f"{vocab_size} entries: the streams were not tokenized for this model"
        )
    bad = (
        df.group_by("stream")
        .agg(ok=(pl.col("pos") == pl.int_range(pl.len())).all())
        .filter(~pl.col("ok"))
    )
    if bad.height:
        raise ValueError(
            f"token table: positions of stream(s) {bad['stream'].to_list()[:5]} are not 0..T-1"
        )
    return df


def iter_streams(df: pl.DataFrame) -> Iterator[tuple[int, pl.DataFrame]]:
    """(stream id, its rows in position order) for every stream of a checked token table."""
    for (stream,), rows in df.group_by("stream", maintain_order=True):
        yield int(stream), rows


# --------------------------------------------------------------------------------------------
# router traces

TRACE_META_KEYS = ("num_experts", "top_k", "num_layers", "norm_topk_prob")


def logits_type(num_experts: int) -> pa.DataType:
    """One row's E float32 logits as fixed_size_binary[4E] (little-endian float32): Parquet
    writes a list column value by value with repetition levels, the binary column as one block
    (measured for 2048 tokens x 4 layers x 512 experts: write 0.028 s vs 0.0095 s, read 0.09 s
    vs 0.005 s). Traces written before as fixed_size_list<float32>[E] still load."""
    return pa.binary(4 * num_experts)


def _logits_width(t: pa.DataType) -> int:
    """E of a logits column type (the binary type above or the older float32 list), else -1."""
    if pa.types.is_fixed_size_binary(t) and t.byte_width % 4 == 0:
        return t.byte_width // 4
    if pa.types.is_fixed_size_list(t) and t.value_type == pa.float32():
        return t.list_size
    return -1


def router_schema(num_experts: int, lookahead: bool = True) -> pa.Schema:
    """Schema of the router-logit table (no column holds nulls); `lookahead=False`: the v1
    schema, without the lookahead logits."""
    fields = [
        pa.field("stream", pa.int32(), nullable=False),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("logits", logits_type(num_experts), nullable=False),
    ]
    if lookahead:
        fields.append(pa.field("lookahead", logits_type(num_experts), nullable=False))
    return pa.schema(fields)


def _logit_list(block: np.ndarray, what: str, shape: tuple[int, ...]) -> pa.Array:
    if block.shape != shape:
        raise ValueError(f"router rows: {what} has shape {block.shape}, expected {shape}")
    flat = np.ascontiguousarray(block, dtype="<f4").reshape(-1)  # [T*L*E]
    rows = flat.size // shape[-1]
    return pa.Array.from_buffers(logits_type(shape[-1]), rows, [None, pa.py_buffer(flat)])


def router_rows(
    stream: int, logits: np.ndarray, pos0: int = 0, lookahead: np.ndarray | None = None
) -> pa.Table:
    """Router-table rows (stream, pos, layer, logits[, lookahead]) for a (T, L, E) float32
    block at pos0 (`lookahead`: the same shape; None writes the v1 schema)."""
    T, L, E = logits.shape
    cols = {
        "stream": pa.array(np.full(T * L, stream, dtype=np.int32)),
        "pos": pa.array(np.repeat(np.arange(pos0, pos0 + T, dtype=np.int32), L)),
        "layer": pa.array(np.tile(np.arange(L, dtype=np.int16), T)),
        "logits": _logit_list(logits, "logits", (T, L, E)),
    }
    if lookahead is not None:
        cols["lookahead"] = _logit_list(lookahead, "lookahead", (T, L, E))
    return pa.table(cols, schema=router_schema(E, lookahead is not None))


def router_writer(
    path: str | os.PathLike,
    num_experts: int,
    metadata: Mapping[str, Any],
    lookahead: bool = True,
) -> ParquetStreamWriter:
    """Row-group-at-a-time writer of a router table, atomic (the file appears on success).

    Dictionary encoding and compression are off for the float logits: pyarrow's default
    dictionary attempt on 512 floats per row made writing ~17x slower (1.65 s vs 0.095 s for
    2048 tokens x 4 layers x 512 experts), which alone would exceed the capture-overhead budget;
    snappy saved nothing. Min/max statistics of the float columns cost ~15% of the write
    (measured: 0.058 s vs 0.049 s for the same table with lookahead) and no reader uses them.
    """
    schema = router_schema(num_experts, lookahead)
    return ParquetStreamWriter(
        path,
        schema,
        metadata,
        use_dictionary=["stream", "pos", "layer"],
        write_statistics=["stream", "pos", "layer"],  # min/max of logits: costly, unused
        compression={
            name: "snappy" if name in ("stream", "pos", "layer") else "none"
            for name in schema.names
        },
    )


@dataclass
class Trace:
    """Captured router logits: `logits[i]` is stream `streams[i]`'s (T_s, L, E) float32 array;
    `lookahead[i]` its lookahead logits, the same shape (None unless loaded with
    `load_trace(..., lookahead=True)`)."""

    streams: list[int]
    logits: list[np.ndarray]
    meta: dict[str, Any]
    lookahead: list[np.ndarray] | None = None

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def num_tokens(self) -> int:
        return sum(z.shape[0] for z in self.logits)


def has_lookahead(router_path: str | os.PathLike) -> bool:
    """Whether a router trace records the lookahead logits (traces captured before policy v2
    do not)."""
    return "lookahead" in pq.read_schema(router_path).names


def _check_router_schema(path: Path, lookahead: bool) -> tuple[int, dict[str, Any]]:
    schema = pq.read_schema(path)
    bad = []
    for name in ("stream", "pos", "layer"):
        if name not in schema.names:
            bad.append(f"missing column {name!r}")
        elif not pa.types.is_integer(schema.field(name).type):
            bad.append(f"column {name!r} is {schema.field(name).type}, expected an integer")
    if "logits" not in schema.names:
        bad.append("missing column 'logits'")
        E = -1
    else:
        t = schema.field("logits").type
        E = _logits_width(t)
        if E < 0:
            bad.append(
                f"column 'logits' is {t}, expected fixed_size_binary[4E] (E float32 values) or "
                "fixed_size_list<float32>[E]"
            )
    if lookahead:
        if "lookahead" not in schema.names:
            raise ValueError(
                f"router trace {str(path)!r} has no lookahead logits (it was captured before "
                "capture recorded them): a prefetch policy needs them; capture the streams "
                "again with this version"
            )
        if schema.field("lookahead").type != schema.field("logits").type:
            bad.append(
                f"column 'lookahead' is {schema.field('lookahead').type}, expected the "
                f"logits' type {schema.field('logits').type}"
            )
    meta = read_metadata(path)
    missing = [k for k in TRACE_META_KEYS if k not in meta]
    if missing:
        bad.append(f"missing metadata {missing}")
    elif E >= 0 and int(meta["num_experts"]) != E:
        bad.append(f"metadata num_experts={meta['num_experts']} but logits have length {E}")
    if bad:
        raise ValueError(f"router trace {str(path)!r}: wrong schema: {'; '.join(bad)}")
    return E, meta


def _logit_rows(column: pa.ChunkedArray, n: int, E: int) -> np.ndarray:
    """(n, E) float32 from a logits column (`logits_type`, or the older float32 list)."""
    out = np.empty((n, E), dtype=np.float32)
    i = 0
    for chunk in column.chunks:
        m = len(chunk)
        if pa.types.is_fixed_size_binary(chunk.type):
            data = chunk.buffers()[1]
            out[i : i + m] = np.frombuffer(data, "<f4", m * E, chunk.offset * 4 * E).reshape(m, E)
        else:
            out[i : i + m] = chunk.flatten().to_numpy(zero_copy_only=False).reshape(m, E)
        i += m
    return out


def load_trace(router_path: str | os.PathLike, lookahead: bool = False) -> Trace:
    """Read a router-logit table back into one (T_s, L, E) float32 array per stream.

    Rows may come in any order (they are sorted by (stream, pos, layer) if needed); every
    stream must hold positions 0..T_s-1 for every layer exactly once, and every logit must be
    finite. `lookahead=True` also reads the lookahead logits (`Trace.lookahead`; a trace
    captured without them is an error that says so).
    """
    path = Path(router_path)
    if not path.is_file():
        raise FileNotFoundError(f"router trace {str(path)!r} does not exist")
    E, meta = _check_router_schema(path, lookahead)
    L = int(meta["num_layers"])
    names = ["stream", "pos", "layer", "logits"] + (["lookahead"] if lookahead else [])
    table = pq.read_table(path, columns=names)
    for name in table.column_names:
        if table.column(name).null_count:
            raise ValueError(f"router trace {str(path)!r}: column {name!r} has nulls")
    n = table.num_rows
    if n == 0:
        raise ValueError(f"router trace {str(path)!r} has no rows")
    stream = table.column("stream").to_numpy().astype(np.int64)
    pos = table.column("pos").to_numpy().astype(np.int64)
    layer = table.column("layer").to_numpy().astype(np.int64)
    logits = _logit_rows(table.column("logits"), n, E)  # [n, E]
    ahead = _logit_rows(table.column("lookahead"), n, E) if lookahead else None
    del table
    if layer.min() < 0 or layer.max() >= L or pos.min() < 0:
        raise ValueError(f"router trace {str(path)!r}: layer outside [0, {L}) or negative pos")
    key = (stream - stream.min()) * ((pos.max() + 1) * L) + pos * L + layer
    if not (np.diff(key) > 0).all():
        order = np.argsort(key, kind="stable")
        stream, pos, layer, key, logits = (
            stream[order], pos[order], layer[order], key[order], logits[order],
        )  # fmt: skip
        ahead = None if ahead is None else ahead[order]
        if not (np.diff(key) > 0).all():
            raise ValueError(f"router trace {str(path)!r}: duplicate (stream, pos, layer) rows")
    for what, values in (("logits", logits), ("lookahead logits", ahead)):
        finite = True if values is None else np.isfinite(values).all(axis=1)
        if not np.all(finite):
            r = int(np.flatnonzero(~finite)[0])
            raise ValueError(
                f"router trace {str(path)!r}: {int((~finite).sum())} row(s) with NaN or "
                f"infinite {what}, first at stream {stream[r]}, pos {pos[r]}, layer {layer[r]}"
            )
    starts = np.flatnonzero(np.r_[True, stream[1:] != stream[:-1]])
    ends = np.r_[starts[1:], n]
    streams, arrays, ahead_arrays = [], [], []
    for a, b in zip(starts, ends, strict=True):
        T = int(pos[b - 1]) + 1
        if b - a != T * L:
            raise ValueError(
                f"router trace {str(path)!r}: stream {stream[a]} has {b - a} rows, expected "
                f"{T} positions x {L} layers"
            )
        streams.append(int(stream[a]))
        arrays.append(logits[a:b].reshape(T, L, E))
        if ahead is not None:
            ahead_arrays.append(ahead[a:b].reshape(T, L, E))
    return Trace(
        streams=streams,
        logits=arrays,
        meta=meta,
        lookahead=ahead_arrays if ahead is not None else None,
    )


# --------------------------------------------------------------------------------------------
# expert ranking (what every cache starts from)

RANKING_COLUMNS = ("layer", "rank", "expert", "count")


def topk_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k largest entries along the last axis, ties to the lower index."""
    E = logits.shape[-1]
    z = logits.reshape(-1, E)  # [n, E]
    kth = np.partition(z, E - k, axis=1)[:, E - k, None]  # [n, 1] the k-th largest value
    greater = z > kth
    eq = z == kth
    need = k - greater.sum(axis=1, keepdims=True)  # how many ties to take, lowest ids first
    mask = greater | (eq & (np.cumsum(eq, axis=1) <= need))
    return mask.reshape(logits.shape)


def selection_counts(trace: Trace, chunk_tokens: int = 4096) -> np.ndarray:
    """(L, E) int64: how often each expert is in a token's top-k, per layer, over the trace."""
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    counts = np.zeros((L, E), dtype=np.int64)
    for z in trace.logits:
        for s in range(0, z.shape[0], chunk_tokens):
            counts += topk_mask(z[s : s + chunk_tokens], k).sum(axis=0)
    return counts


def frequency_sets(counts: np.ndarray, capacity: int) -> np.ndarray:
    """(L, C) int32 frequency set from (L, E) selection counts: per layer the C experts
    selected most often, most selected first, ties to the lower id. With C = E it is the
    layer's whole ranking, and every layout's initial set is a prefix of it."""
    order = np.argsort(-counts, axis=1, kind="stable")
    return order[:, :capacity].astype(np.int32)


def write_expert_ranking(
    counts: np.ndarray, out_path: str | os.PathLike, metadata: Mapping[str, Any]
) -> Path:
    """The expert-ranking artefact from (L, E) selection counts, atomically: per layer every
    expert in rank order (`frequency_sets(counts, E)`) with its count."""
    L, E = counts.shape
    order = frequency_sets(counts, E)  # (L, E)
    table = pa.table(
        {
            "layer": np.repeat(np.arange(L, dtype=np.int16), E),
            "rank": np.tile(np.arange(E, dtype=np.int32), L),
            "expert": order.reshape(-1),
            "count": np.take_along_axis(counts, order, axis=1).reshape(-1).astype(np.int64),
        }
    )
    return write_parquet(table, out_path, metadata=dict(metadata))


def read_expert_ranking(path: str | os.PathLike, num_layers: int, num_experts: int) -> np.ndarray:
    """The (L, E) int32 expert ranking (per layer every expert, most selected first), checked
    against the model's L and E."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert ranking {str(path)!r} does not exist")
    names = pq.read_schema(path).names
    if any(c not in names for c in RANKING_COLUMNS):
        raise ValueError(f"expert ranking {str(path)!r}: expected columns {list(RANKING_COLUMNS)}")
    t = pq.read_table(path, columns=["layer", "rank", "expert"])
    layer = t.column("layer").to_numpy().astype(np.int64)
    rank = t.column("rank").to_numpy().astype(np.int64)
    if len(layer) != num_layers * num_experts or layer.min() < 0 or layer.max() >= num_layers:
        raise ValueError(
            f"expert ranking {str(path)!r}: {len(layer)} rows for layers "
            f"{sorted(set(layer.tolist()))[:8]}, expected the model's {num_layers} layers x "
            f"{num_experts} experts (a ranking of another model?)"
        )
    out = np.full((num_layers, num_experts), -1, dtype=np.int64)
    out[layer, rank] = t.column("expert").to_numpy()
    try:
        return check_ranking(out, num_layers, num_experts)
    except ValueError as e:
        raise ValueError(f"expert ranking {str(path)!r}: {e}") from None


def layout_for(
    ranking_path: str | os.PathLike | None,
    size: float | Mapping[str, Any] | CacheSize,
    policy: Mapping[str, Any] | Policy,
    top_k: int,
    num_layers: int,
    num_experts: int,
    allocation_path: str | os.PathLike | None = None,
) -> CacheLayout:
    """Every stage's layout: `moesub.layout.build_layout` on the model's expert ranking
    (`ranking_path`; None: experts by id, so each cache starts with experts 0..C_l-1) and, for a
    planned policy, its allocation artefact (`allocation_path`)."""
    ranking = (
        np.tile(np.arange(num_experts, dtype=np.int32), (num_layers, 1))
        if ranking_path is None
        else read_expert_ranking(ranking_path, num_layers, num_experts)
    )
    allocation = None
    if allocation_path is not None:
        capacity = CacheSize.of(size, num_experts).capacity
        allocation = read_allocation(allocation_path, num_layers, capacity)
    return build_layout(ranking, size, policy, top_k, allocation)
