"""Exact capture (token table + router-logit table), trace loading, initial resident sets.

Capture runs the exact model (every expert resident) over the streams with teacher forcing:
streams of equal length go through `moesub.models.stream_nll` (the same call the emulator
makes) in batches of at most `batch_tokens` tokens (`moesub.models.stream_batches`; recorded in
the token table's metadata so that replays batch identically), with a `RouterHook` recording
every MoE layer's router logits.

Router table rows are written in (stream, pos, layer) order, one fixed-size float32 list of
length E per row, in row groups of about `row_group_mb`, by a background thread. Memory is
bounded by one batch's logits (B x T x L x E float32) plus two pending row groups. `load_trace`
reads the table back into one `(T, L, E)` float32 array per stream.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from moesub.io import ParquetStreamWriter, read_metadata, write_parquet
from moesub.params import options_from, torch_device

STREAM_COLUMNS = ("stream", "pos", "token_id", "doc_id", "doc_start")
TRACE_META_KEYS = ("num_experts", "top_k", "num_layers", "norm_topk_prob")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def logits_type(num_experts: int) -> pa.DataType:
    """fixed_size_list<float32 not null>[E]: non-null items read back ~2x faster than nullable."""
    return pa.list_(pa.field("item", pa.float32(), nullable=False), num_experts)


def router_schema(num_experts: int) -> pa.Schema:
    """Schema of the router-logit table (no column holds nulls)."""
    return pa.schema(
        [
            pa.field("stream", pa.int32(), nullable=False),
            pa.field("pos", pa.int32(), nullable=False),
            pa.field("layer", pa.int16(), nullable=False),
            pa.field("logits", logits_type(num_experts), nullable=False),
        ]
    )


@dataclass(frozen=True)
class CaptureParams:
    """Config `capture:` section (all optional)."""

    dtype: str = "float32"  # model dtype: float32 | bfloat16 | float16
    device: str = "cpu"  # torch device, or "auto" (cuda if available)
    row_group_mb: float = 64.0  # router-table row-group size
    batch_tokens: int = 4096  # tokens per teacher-forced forward (equal-length streams batched)
    name: str | None = None  # recorded as metadata `model` (default: the model directory)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> CaptureParams:
        p = options_from(cls, params, "capture")
        if p.dtype not in _DTYPES:
            raise ValueError(f"capture params dtype: {p.dtype!r} not in {sorted(_DTYPES)}")
        if not (p.row_group_mb > 0):
            raise ValueError(f"capture params row_group_mb: must be > 0, got {p.row_group_mb!r}")
        if (
            isinstance(p.batch_tokens, bool)
            or not isinstance(p.batch_tokens, int)
            or p.batch_tokens < 1
        ):
            raise ValueError(
                f"capture params batch_tokens: must be an integer >= 1, got {p.batch_tokens!r}"
            )
        return p


# --------------------------------------------------------------------------------------------
# streams input


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
        target = pa.schema(
            [
                ("stream", pa.int32()),
                ("pos", pa.int32()),
                ("token_id", pa.int32()),
                ("doc_id", pa.int32()),
                ("doc_start", pa.bool_()),
            ]
        )
        table = table.cast(target)
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


# --------------------------------------------------------------------------------------------
# capture


class _Recorder:
    """RouterHook callback keeping each MoE layer's logits [T, E] of the current forward."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.logits: list[torch.Tensor | None] = [None] * num_layers

    def __call__(self, layer: int, logits: torch.Tensor, weights, ids) -> None:
        if self.logits[layer] is not None:
            raise RuntimeError(f"router of MoE layer {layer} ran twice in one forward")
        self.logits[layer] = logits.detach()
        return None

    def take(self) -> np.ndarray:
        """(N, L, E) float32 of the last forward (N = B*T rows, batch-major); resets."""
        if any(z is None for z in self.logits):
            raise RuntimeError("not every MoE layer's router ran in the forward")
        out = torch.stack(self.logits, dim=1).cpu().numpy()  # type: ignore[arg-type]
        self.logits = [None] * self.num_layers
        return out


def router_rows(stream: int, logits: np.ndarray, pos0: int = 0) -> pa.Table:
    """Router-table rows (stream, pos, layer, logits) for a (T, L, E) float32 block at pos0."""
    T, L, E = logits.shape
    flat = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)  # [T*L*E]
    return pa.table(
        {
            "stream": pa.array(np.full(T * L, stream, dtype=np.int32)),
            "pos": pa.array(np.repeat(np.arange(pos0, pos0 + T, dtype=np.int32), L)),
            "layer": pa.array(np.tile(np.arange(L, dtype=np.int16), T)),
            "logits": pa.FixedSizeListArray.from_arrays(pa.array(flat), type=logits_type(E)),
        },
        schema=router_schema(E),
    )


def capture_batch(
    model: torch.nn.Module,
    writer: ParquetStreamWriter | BackgroundWriter,
    stream_ids: list[int],
    token_ids: np.ndarray,
    rows_per_group: int,
) -> np.ndarray:
    """Capture B equal-length streams in one teacher-forced forward, recording every router.

    `token_ids` (B, T). Writes each stream's router rows to `writer` (`rows_per_group`
    positions per row group) and returns the NLL `(B, T)` float64 (NaN at position 0).
    """
    from moesub.models import RouterHook, moe_blocks, stream_nll

    recorder = _Recorder(len(moe_blocks(model)))
    ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))  # (B, T)
    B, T = ids.shape
    with RouterHook(model, recorder):
        nll = stream_nll(model, ids)  # (B, T)
    logits = recorder.take()  # (B*T, L, E) float32
    logits = logits.reshape(B, T, *logits.shape[1:])  # (B, T, L, E)
    for b, stream_id in enumerate(stream_ids):
        if not np.isfinite(logits[b]).all():
            raise ValueError(
                f"stream {stream_id}: the model produced NaN or infinite router logits"
            )
        for p in range(0, T, rows_per_group):
            writer.write_table(router_rows(stream_id, logits[b, p : p + rows_per_group], p))
    return nll


class BackgroundWriter:
    """Runs `writer.write_table` on a worker thread so Parquet I/O overlaps the next forward.

    At most `max_pending` tables wait in the queue (bounded memory). An error on the worker is
    re-raised by the next `write_table` or by `close`. Use as a context manager.
    """

    def __init__(self, writer: Any, max_pending: int = 2):
        self._writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="router-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (table := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._writer.write_table(table)
                except BaseException as e:  # re-raised on the caller's thread
                    self._error = e

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def write_table(self, table: pa.Table) -> None:
        self._check()
        self._queue.put(table)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._check()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def router_writer(
    path: str | os.PathLike, num_experts: int, metadata: Mapping[str, Any]
) -> ParquetStreamWriter:
    """Row-group-at-a-time writer of a router table, atomic (the file appears on success).

    Dictionary encoding and compression are off for the float logits: pyarrow's default
    dictionary attempt on 512 floats per row made writing ~17x slower (1.65 s vs 0.095 s for
    2048 tokens x 4 layers x 512 experts), which alone would exceed the capture-overhead budget;
    snappy saved nothing.
    """
    return ParquetStreamWriter(
        path,
        router_schema(num_experts),
        metadata,
        use_dictionary=["stream", "pos", "layer"],
        compression={"stream": "snappy", "pos": "snappy", "layer": "snappy", "logits": "none"},
    )


def run_capture(
    model_dir: str | os.PathLike,
    streams_path: str | os.PathLike,
    out_tokens: str | os.PathLike,
    out_router: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> None:
    """Capture NLL and router logits of the exact model over every stream (see module doc)."""
    from moesub.models import load_model, moe_info, stream_batches

    opts = CaptureParams.from_dict(params)
    table, streams_meta = read_streams(streams_path)
    model, _ = load_model(model_dir, dtype=_DTYPES[opts.dtype], device=torch_device(opts.device))
    info = moe_info(model)
    token_ids = table.column("token_id").to_numpy()
    if token_ids.min() < 0 or token_ids.max() >= info.vocab_size:
        raise ValueError(
            f"streams file {str(streams_path)!r}: token ids span [{token_ids.min()}, "
            f"{token_ids.max()}], outside the model's vocabulary of {info.vocab_size}"
        )
    L, E = info.num_layers, info.num_experts
    meta = {
        "num_experts": E,
        "top_k": info.top_k,
        "num_layers": L,
        "norm_topk_prob": info.norm_topk_prob,
        "model": opts.name if opts.name is not None else str(model_dir),
        "family": info.family,
        "layer_indices": list(info.layer_indices),
        "dtype": opts.dtype,
        "batch_tokens": opts.batch_tokens,
    }
    rows_per_group = max(1, int(opts.row_group_mb * 2**20 // (4 * E * L)))  # positions per group
    stream = table.column("stream").to_numpy()
    starts = np.flatnonzero(np.r_[True, stream[1:] != stream[:-1]])
    lengths = np.diff(np.r_[starts, len(stream)])
    batches = stream_batches(lengths.tolist(), opts.batch_tokens)
    nll = np.full(len(stream), np.nan)
    with router_writer(out_router, E, meta) as file_writer, BackgroundWriter(file_writer) as writer:
        for batch in tqdm(batches, desc="capture", unit="batch"):
            T = int(lengths[batch[0]])
            rows = starts[batch][:, None] + np.arange(T)  # (B, T) row indices
            ids = [int(stream[starts[i]]) for i in batch]
            nll[rows] = capture_batch(model, writer, ids, token_ids[rows], rows_per_group)
    pos = table.column("pos").to_numpy()
    tokens = table.append_column("nll", pa.array(nll, type=pa.float64(), mask=pos == 0))
    write_parquet(tokens, out_tokens, metadata={**streams_meta, **meta})


# --------------------------------------------------------------------------------------------
# trace loading


@dataclass
class Trace:
    """Captured router logits: `logits[i]` is stream `streams[i]`'s (T_s, L, E) float32 array."""

    streams: list[int]
    logits: list[np.ndarray]
    meta: dict[str, Any]

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


def _check_router_schema(path: Path) -> tuple[int, dict[str, Any]]:
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
        if not (pa.types.is_fixed_size_list(t) and t.value_type == pa.float32()):
            bad.append(f"column 'logits' is {t}, expected fixed_size_list<float32>[E]")
            E = -1
        else:
            E = t.list_size
    meta = read_metadata(path)
    missing = [k for k in TRACE_META_KEYS if k not in meta]
    if missing:
        bad.append(f"missing metadata {missing}")
    elif E >= 0 and int(meta["num_experts"]) != E:
        bad.append(f"metadata num_experts={meta['num_experts']} but logits have length {E}")
    if bad:
        raise ValueError(f"router trace {str(path)!r}: wrong schema: {'; '.join(bad)}")
    return E, meta


def load_trace(router_path: str | os.PathLike) -> Trace:
    """Read a router-logit table back into one (T_s, L, E) float32 array per stream.

    Rows may come in any order (they are sorted by (stream, pos, layer) if needed); every
    stream must hold positions 0..T_s-1 for every layer exactly once, and every logit must be
    finite.
    """
    path = Path(router_path)
    if not path.is_file():
        raise FileNotFoundError(f"router trace {str(path)!r} does not exist")
    E, meta = _check_router_schema(path)
    L = int(meta["num_layers"])
    table = pq.read_table(path, columns=["stream", "pos", "layer", "logits"])
    for name in table.column_names:
        if table.column(name).null_count:
            raise ValueError(f"router trace {str(path)!r}: column {name!r} has nulls")
    n = table.num_rows
    if n == 0:
        raise ValueError(f"router trace {str(path)!r} has no rows")
    stream = table.column("stream").to_numpy().astype(np.int64)
    pos = table.column("pos").to_numpy().astype(np.int64)
    layer = table.column("layer").to_numpy().astype(np.int64)
    logits = np.empty((n, E), dtype=np.float32)  # [n, E]
    i = 0
    for chunk in table.column("logits").chunks:
        logits[i : i + len(chunk)] = chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, E)
        i += len(chunk)
    del table
    if layer.min() < 0 or layer.max() >= L or pos.min() < 0:
        raise ValueError(f"router trace {str(path)!r}: layer outside [0, {L}) or negative pos")
    key = (stream - stream.min()) * ((pos.max() + 1) * L) + pos * L + layer
    if not (np.diff(key) > 0).all():
        order = np.argsort(key, kind="stable")
        stream, pos, layer, key, logits = (
            stream[order], pos[order], layer[order], key[order], logits[order],
        )  # fmt: skip
        if not (np.diff(key) > 0).all():
            raise ValueError(f"router trace {str(path)!r}: duplicate (stream, pos, layer) rows")
    finite = np.isfinite(logits).all(axis=1)
    if not finite.all():
        r = int(np.flatnonzero(~finite)[0])
        raise ValueError(
            f"router trace {str(path)!r}: {int((~finite).sum())} row(s) with NaN or infinite "
            f"logits, first at stream {stream[r]}, pos {pos[r]}, layer {layer[r]}"
        )
    starts = np.flatnonzero(np.r_[True, stream[1:] != stream[:-1]])
    ends = np.r_[starts[1:], n]
    streams, arrays = [], []
    for a, b in zip(starts, ends, strict=True):
        T = int(pos[b - 1]) + 1
        if b - a != T * L:
            raise ValueError(
                f"router trace {str(path)!r}: stream {stream[a]} has {b - a} rows, expected "
                f"{T} positions x {L} layers"
            )
        streams.append(int(stream[a]))
        arrays.append(logits[a:b].reshape(T, L, E))
    return Trace(streams=streams, logits=arrays, meta=meta)


# --------------------------------------------------------------------------------------------
# initial resident sets


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


def _capacity(fraction: float, num_experts: int) -> int:
    return int(math.floor(fraction * num_experts + 0.5))


def _sets_from_counts(counts: np.ndarray, capacity: int) -> np.ndarray:
    order = np.argsort(-counts, axis=1, kind="stable")  # most selected first, ties to lower id
    return order[:, :capacity].astype(np.int32)


def frequency_initial_sets(trace: Trace, capacities: Iterable[int]) -> dict[int, np.ndarray]:
    """{C: (L, C) int32}: per layer the C experts selected most often, ties to the lower id."""
    caps = [int(c) for c in capacities]
    for c in caps:
        if not (trace.top_k <= c <= trace.num_experts):
            raise ValueError(f"capacities: {c} is outside [k={trace.top_k}, E={trace.num_experts}]")
    counts = selection_counts(trace)
    return {c: _sets_from_counts(counts, c) for c in caps}


def write_initial_sets(
    calib_router_path: str | os.PathLike,
    fractions: Iterable[float],
    out_path: str | os.PathLike,
) -> None:
    """Frequency initial resident sets for each cache fraction, from a calibration capture."""
    fractions = [float(f) for f in fractions]
    if not fractions:
        raise ValueError("fractions: empty")
    for f in fractions:
        if not (0 < f <= 1):
            raise ValueError(f"fractions: {f!r} is not in (0, 1]")
    trace = load_trace(calib_router_path)
    E, k, L = trace.num_experts, trace.top_k, trace.num_layers
    caps = {f: _capacity(f, E) for f in fractions}
    for f, c in caps.items():
        if c < k:
            raise ValueError(
                f"fractions: {f} gives capacity {c} < top_k {k} (E={E}); use a larger fraction"
            )
    sets = frequency_initial_sets(trace, sorted(set(caps.values())))
    cols: dict[str, list[np.ndarray]] = {n: [] for n in ("fraction", "capacity", "layer", "rank")}
    cols["expert"] = []
    for f in fractions:
        c = caps[f]
        cols["fraction"].append(np.full(L * c, f, dtype=np.float64))
        cols["capacity"].append(np.full(L * c, c, dtype=np.int32))
        cols["layer"].append(np.repeat(np.arange(L, dtype=np.int16), c))
        cols["rank"].append(np.tile(np.arange(c, dtype=np.int32), L))
        cols["expert"].append(sets[c].reshape(-1))
    table = pa.table({n: np.concatenate(v) for n, v in cols.items()})
    meta = {
        "num_experts": E,
        "top_k": k,
        "num_layers": L,
        "source": str(calib_router_path),
        "tokens": trace.num_tokens,
    }
    write_parquet(table, out_path, metadata=meta)


def read_initial_set(path: str | os.PathLike, fraction: float) -> np.ndarray:
    """The (L, C) int32 initial resident set for `fraction`, in rank order (most selected first)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"initial sets file {str(path)!r} does not exist")
    need = ("fraction", "capacity", "layer", "rank", "expert")
    names = pq.read_schema(path).names
    if any(c not in names for c in need):
        raise ValueError(f"initial sets file {str(path)!r}: expected columns {list(need)}")
    t = pq.read_table(path, columns=list(need))
    frac = t.column("fraction").to_numpy()
    sel = np.isclose(frac, float(fraction), rtol=0, atol=1e-9)
    if not sel.any():
        raise ValueError(
            f"initial sets file {str(path)!r}: no set for fraction {fraction!r}; "
            f"available {sorted(set(frac.tolist()))}"
        )
    layer = t.column("layer").to_numpy()[sel].astype(np.int64)
    rank = t.column("rank").to_numpy()[sel].astype(np.int64)
    expert = t.column("expert").to_numpy()[sel].astype(np.int32)
    C = int(t.column("capacity").to_numpy()[sel][0])
    L = int(layer.max()) + 1
    if len(expert) != L * C:
        raise ValueError(
            f"initial sets file {str(path)!r}: fraction {fraction}: {len(expert)} rows, "
            f"expected {L} layers x capacity {C}"
        )
    out = np.full((L, C), -1, dtype=np.int32)
    out[layer, rank] = expert
    if (out < 0).any():
        raise ValueError(f"initial sets file {str(path)!r}: fraction {fraction}: incomplete set")
    return out
