"""What every trace format shares: the in-memory trace, its chunks, the named error, the
(token, layer) record grid and the conversions between probabilities, logits and ids.

Conventions (docs/traces.md):
- **probabilities -> logits**: `log p` (softmax is shift-invariant, so the selection, the
  normalized gate weights and the route_bias range are those of the original logits, up to
  float32 rounding). A zero probability becomes `ZERO_LOGIT` (-104), below the logarithm of
  every positive float32 (>= log 2^-149 = -103.28): zero-probability experts rank below every
  positive one (ties to the lower id) and get a gate weight below 1e-40.
- **incomplete records**: a layer no record mentions is not an MoE layer and is left out
  (`layers` keeps the file's numbering of the rest); a token with records for some layers but
  not all is an error, or with `incomplete="drop"` is left out (every layer loses it); a token
  number with no record at all below the largest (a token gap) is always an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moesub.artefacts import topk_mask
from moesub.policy import Policy

ZERO_LOGIT = np.float32(-104.0)
INCOMPLETE = ("error", "drop")


class TraceFormatError(ValueError):
    """A trace file that does not hold what its format promises: names the file, where in it
    (byte offset, record or line) and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str, where: str | None = None) -> None:
        self.path, self.problem, self.where = Path(path), problem, where
        at = f", {where}" if where else ""
        super().__init__(f"trace {str(path)!r}{at}: {problem}")


@dataclass(frozen=True)
class TraceChunk:
    """Consecutive tokens of one stream, layer-major so that each layer's rows are contiguous
    (what `LayerCache.step` takes). `stream_start`: the first chunk of a stream (caches restart)."""

    stream_start: bool
    logits: np.ndarray | None  # float32 (L, Tc, E); None for a trace of ids only
    ids: np.ndarray | None  # int32 (L, Tc, k) when there are no logits, else None


@dataclass(frozen=True, eq=False)
class RouterTrace:
    """A router trace in memory, whatever file it came from.

    `ids` are the selected experts by rank (for a trace with logits: the top-k of the logits,
    ties to the lower id, which is what the policy core selects). `layers[i]` is the file's
    number of MoE layer i; `streams` the token count of each stream (caches restart at each;
    only moesub's own traces hold more than one); `dropped_tokens` the tokens left out as
    incomplete (`incomplete="drop"`).
    """

    ids: np.ndarray  # int32 (T, L, k)
    logits: np.ndarray | None  # float32 (T, L, E), None where the format holds ids only
    num_experts: int
    format: str
    path: Path | None
    layers: tuple[int, ...]
    streams: tuple[int, ...]
    dropped_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        T, L, k = self.ids.shape
        if self.ids.dtype != np.int32:
            raise ValueError(f"RouterTrace ids: dtype must be int32, got {self.ids.dtype}")
        shape = (T, L, self.num_experts)
        if self.logits is not None and self.logits.shape != shape:
            raise ValueError(f"RouterTrace logits: shape {self.logits.shape}, expected {shape}")
        if len(self.layers) != L or sum(self.streams) != T:
            raise ValueError(
                f"RouterTrace: {len(self.layers)} layer numbers for {L} layers, or streams "
                f"{self.streams} do not add up to {T} tokens"
            )

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def has_logits(self) -> bool:
        return self.logits is not None

    def load(self) -> RouterTrace:
        return self

    def selection_counts(self) -> np.ndarray:
        """(L, E) int64: how often each expert is selected, per layer."""
        L, E = self.num_layers, self.num_experts
        flat = (self.ids + (np.arange(L, dtype=np.int64) * E)[None, :, None]).reshape(-1)
        return np.bincount(flat, minlength=L * E).reshape(L, E)

    def chunks(self, chunk_tokens: int) -> Iterator[TraceChunk]:
        for t0, t1, start in stream_spans(self.streams, chunk_tokens):
            if self.logits is not None:
                block = np.ascontiguousarray(self.logits[t0:t1].transpose(1, 0, 2))
                yield TraceChunk(start, block, None)
            else:
                yield TraceChunk(
                    start, None, np.ascontiguousarray(self.ids[t0:t1].transpose(1, 0, 2))
                )


def stream_spans(streams: tuple[int, ...], chunk_tokens: int) -> Iterator[tuple[int, int, bool]]:
    """(t0, t1, first chunk of its stream) over the streams, at most chunk_tokens each."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: must be >= 1, got {chunk_tokens}")
    s0 = 0
    for n in streams:
        for t0 in range(s0, s0 + n, chunk_tokens):
            yield t0, min(t0 + chunk_tokens, s0 + n), t0 == s0
        s0 += n


# --------------------------------------------------------------------------------------------
# conversions


def probabilities_to_logits(p: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 logits `log p`, zeros to ZERO_LOGIT; `p` must be checked (finite, >= 0)."""
    with np.errstate(divide="ignore"):
        z = np.log(p, out=out, dtype=np.float32)
    return np.maximum(z, ZERO_LOGIT, out=z)  # only -inf (p = 0) lies below -103.28


def softmax_probabilities(logits: np.ndarray) -> np.ndarray:
    """float32 softmax over the last axis, computed in float64 (underflow below the smallest
    float32 gives 0)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z.astype(np.float32)


def ranked_topk(logits: np.ndarray, k: int, chunk_rows: int = 8192) -> np.ndarray:
    """int32 (..., k): the k largest logits' experts by rank, ties to the lower id (the policy
    core's selection)."""
    E = logits.shape[-1]
    z = logits.reshape(-1, E)  # (n, E)
    out = np.empty((z.shape[0], k), np.int32)
    for s in range(0, z.shape[0], chunk_rows):
        zc = z[s : s + chunk_rows]
        ids = np.nonzero(topk_mask(zc, k))[1].reshape(-1, k)  # (m, k) ascending ids
        order = np.argsort(-np.take_along_axis(zc, ids, axis=1), axis=1, kind="stable")
        out[s : s + len(zc)] = np.take_along_axis(ids, order, axis=1)
    return out.reshape(*logits.shape[:-1], k)


def rank_logits(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 (..., E) stand-in logits whose top-k is exactly `ids` in rank order (rank r gets
    k - r, every other expert 0). Their gate weights mean nothing: only for policies
    `logits_needed` passes."""
    k = ids.shape[-1]
    out = np.zeros((*ids.shape[:-1], num_experts), np.float32)
    np.put_along_axis(out, ids.astype(np.intp), np.arange(k, 0, -1, dtype=np.float32), axis=-1)
    return out


def logits_needed(policy: Policy) -> str | None:
    """What `policy` reads that a trace of expert ids lacks (None: the ids suffice). Rules that
    never read a weight or a non-selected logit run on ids: fetch_all and host_compute with any
    online eviction, and first_choice whose light misses run on the host."""
    if policy.route_bias > 0:
        return "route_bias ranks by every expert's logit"
    if policy.rule == "threshold":
        return "rule 'threshold' compares gate weights with tau"
    if policy.rule in ("substitute_all", "first_choice") and policy.light_miss == "substitute":
        return f"rule {policy.rule!r} picks each substitute by the residents' logits"
    return None


def check_id_rows(
    path: Path, ids: np.ndarray, num_experts: int, where: Callable[[int], str]
) -> None:
    """Every (n, k) row: ids in [0, E), no expert twice."""
    bad = np.flatnonzero(((ids < 0) | (ids >= num_experts)).any(axis=1))
    if bad.size:
        r = int(bad[0])
        raise TraceFormatError(
            path, f"expert ids {ids[r].tolist()} outside [0, n_expert={num_experts})", where(r)
        )
    srt = np.sort(ids, axis=1)
    bad = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
    if bad.size:
        r = int(bad[0])
        raise TraceFormatError(path, f"expert ids {ids[r].tolist()} repeat an expert", where(r))


# --------------------------------------------------------------------------------------------
# the (token, layer) record grid


@dataclass(frozen=True)
class RecordGrid:
    """Which record holds each (kept token, MoE layer)."""

    tokens: np.ndarray  # int64 (T,): the file's token number of each kept token
    layers: tuple[int, ...]  # the file's layer number of each MoE layer
    record: np.ndarray  # int64 (T, L): record (row) number
    dropped_tokens: int


def record_grid(
    path: Path,
    token: np.ndarray,
    layer: np.ndarray,
    where: Callable[[int], str],
    incomplete: str,
) -> RecordGrid:
    """Check the (token, layer) of every record (int64 (n,) each) and lay them on a grid:
    no negative number, no (token, layer) twice, no token gap, incomplete tokens per
    `incomplete` (module docstring)."""
    if incomplete not in INCOMPLETE:
        raise ValueError(f"incomplete: expected one of {INCOMPLETE}, got {incomplete!r}")
    if len(token) == 0:
        raise TraceFormatError(path, "holds no records")
    bad = np.flatnonzero((token < 0) | (layer < 0))
    if bad.size:
        r = int(bad[0])
        raise TraceFormatError(
            path, f"negative token {token[r]} or layer {layer[r]} number", where(r)
        )
    tok_ids, tok_pos = np.unique(token, return_inverse=True)
    gaps = np.flatnonzero(tok_ids != np.arange(len(tok_ids)))
    if gaps.size:
        t = int(gaps[0])
        raise TraceFormatError(
            path,
            f"token gap: no record for token {t} at any layer, though tokens up to "
            f"{int(tok_ids[-1])} are recorded",
        )
    lay_ids, lay_pos = np.unique(layer, return_inverse=True)
    T, L = len(tok_ids), len(lay_ids)
    key = tok_pos.astype(np.int64) * L + lay_pos
    counts = np.bincount(key, minlength=T * L)
    if (counts > 1).any():
        first, second = np.flatnonzero(key == np.flatnonzero(counts > 1)[0])[:2]
        raise TraceFormatError(
            path,
            f"a second record for token {token[second]}, layer {layer[second]} (the first is "
            f"at {where(int(first))})",
            where(int(second)),
        )
    record = np.full(T * L, -1, np.int64)
    record[key] = np.arange(len(key))
    record = record.reshape(T, L)
    lacking = (record < 0).any(axis=1)  # (T,)
    if lacking.any():
        t = int(np.flatnonzero(lacking)[0])
        l = int(lay_ids[np.flatnonzero(record[t] < 0)[0]])
        if incomplete == "error":
            raise TraceFormatError(
                path,
                f"incomplete: token {t} has no record for layer {l} ({int(lacking.sum())} of "
                f"{T} tokens lack a layer that other tokens have); read with "
                "incomplete='drop' to keep only the complete tokens",
            )
        if lacking.all():
            raise TraceFormatError(path, "no token has a record for every layer")
    keep = ~lacking
    return RecordGrid(
        tokens=tok_ids[keep].astype(np.int64),
        layers=tuple(int(x) for x in lay_ids),
        record=record[keep],
        dropped_tokens=int(lacking.sum()),
    )


def ids_trace(
    path: Path,
    fmt: str,
    rows: np.ndarray,
    grid: RecordGrid,
    num_experts: int,
    meta: dict[str, Any] | None = None,
) -> RouterTrace:
    """The RouterTrace of a format holding ids only: `rows` (n, k) per record, laid on `grid`."""
    return RouterTrace(
        ids=np.ascontiguousarray(rows[grid.record], dtype=np.int32),  # (T, L, k)
        logits=None,
        num_experts=num_experts,
        format=fmt,
        path=path,
        layers=grid.layers,
        streams=(len(grid.tokens),),
        dropped_tokens=grid.dropped_tokens,
        meta=meta or {},
    )
