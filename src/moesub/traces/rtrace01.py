"""RTRACE01, fitz-tec's `llama-router-trace` format: full router probabilities.

Little-endian: `b"RTRACE01"`, int32 n_experts, int32 version (0), then one record per
(token, layer) in any order: `int32 token, int32 layer, float32 probs[n_experts]`. The file
does not record the model's top-k; the reader takes it from the caller.

`Rtrace01File` checks a whole file in one pass (header, size, every record's numbers and
probabilities) and keeps only where each (token, layer) record lies; its chunks read the
probabilities back from disk a few tokens at a time, so a file larger than memory replays in
bounded memory. The writer's records go token by token, layers in order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moesub.traces.base import (
    RouterTrace,
    TraceChunk,
    TraceFormatError,
    probabilities_to_logits,
    ranked_topk,
    record_grid,
    softmax_probabilities,
    stream_spans,
)

MAGIC = b"RTRACE01"
VERSION = 0
HEADER_BYTES = 16
MAX_EXPERTS = 1 << 20  # a header above this is corrupt, not a model
INDEX_BLOCK_BYTES = 32 << 20  # records read per block of the checking pass


def record_dtype(num_experts: int) -> np.dtype:
    return np.dtype([("token", "<i4"), ("layer", "<i4"), ("probs", "<f4", (num_experts,))])


def header(num_experts: int) -> bytes:
    return MAGIC + np.array([num_experts, VERSION], "<i4").tobytes()


def encode(logits: np.ndarray, token0: int) -> np.ndarray:
    """Records of float32 (T, L, E) logits for tokens token0.., token-major: softmax
    probabilities (float32)."""
    T, L, E = logits.shape
    rec = np.empty((T, L), record_dtype(E))
    rec["token"] = np.arange(token0, token0 + T, dtype=np.int32)[:, None]
    rec["layer"] = np.arange(L, dtype=np.int32)[None, :]
    rec["probs"] = softmax_probabilities(logits)
    return rec


def read_header(path: Path) -> tuple[int, int]:
    """(n_experts, number of records), the file's size checked against them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head.startswith(MAGIC) and not MAGIC.startswith(head):  # a short head: truncated
        raise TraceFormatError(path, f"wrong magic {head[:8]!r}, expected {MAGIC!r}", "offset 0")
    if len(head) < HEADER_BYTES:
        raise TraceFormatError(path, f"truncated: {size} bytes, the header alone is {HEADER_BYTES}")
    E, version = (int(v) for v in np.frombuffer(head, "<i4", 2, 8))
    if not 1 <= E <= MAX_EXPERTS:
        raise TraceFormatError(path, f"n_experts {E} is not in [1, {MAX_EXPERTS}]", "offset 8")
    if version != VERSION:
        raise TraceFormatError(path, f"header version {version}, expected {VERSION}", "offset 12")
    rs = record_dtype(E).itemsize
    n, tail = divmod(size - HEADER_BYTES, rs)
    if tail:
        raise TraceFormatError(
            path,
            f"truncated: the last record has {tail} of its {rs} bytes (n_experts {E})",
            f"offset {HEADER_BYTES + n * rs}",
        )
    return E, n


class Rtrace01File:
    """An RTRACE01 file, checked whole and indexed; the probabilities stay on disk.

    Checks: the header, a size that is a whole number of records, every record's token and
    layer (`moesub.traces.base.record_grid`) and probabilities (finite, >= 0, one > 0).
    """

    format = "rtrace01"
    has_logits = True

    def __init__(self, path: str | os.PathLike, top_k: int | None, incomplete: str = "error"):
        self.path = Path(path)
        E, n = read_header(self.path)
        if top_k is None:
            raise ValueError(
                f"trace {str(self.path)!r}: RTRACE01 does not record the model's top-k; pass top_k"
            )
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k: {top_k} is not in [1, n_experts={E}]")
        self.num_experts, self.top_k = E, int(top_k)
        self._dtype = record_dtype(E)
        token, layer = self._check_records(n)
        grid = record_grid(self.path, token, layer, self._where, incomplete)
        self.layers, self.dropped_tokens = grid.layers, grid.dropped_tokens
        self._tokens, self._record = grid.tokens, grid.record  # (T,), (T, L)
        self.streams = (len(grid.tokens),)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def _where(self, record: int) -> str:
        return f"record {record} (offset {HEADER_BYTES + record * self._dtype.itemsize})"

    def _check_records(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """One pass over the file: every record's (token, layer), its probabilities checked."""
        token, layer = np.empty(n, np.int64), np.empty(n, np.int64)
        block = max(1, INDEX_BLOCK_BYTES // self._dtype.itemsize)
        buf = np.empty(min(block, n), self._dtype)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(HEADER_BYTES)
            for r0 in range(0, n, block):
                m = min(block, n - r0)
                self._read_into(f, buf[:m], r0)
                token[r0 : r0 + m], layer[r0 : r0 + m] = buf["token"][:m], buf["layer"][:m]
                self._check_probs(buf["probs"][:m], r0)
        return token, layer

    def _read_into(self, f, out: np.ndarray, record0: int) -> None:
        view = memoryview(out.view(np.uint8))
        got = 0
        while got < len(view):
            r = f.readinto(view[got:])
            if not r:
                raise TraceFormatError(
                    self.path,
                    "ended early: the file shrank while it was read",
                    self._where(record0),
                )
            got += r

    def _check_probs(self, p: np.ndarray, record0: int) -> None:
        lo, hi = p.min(axis=1), p.max(axis=1)  # NaN propagates into both
        bad = np.flatnonzero(~(lo >= 0) | ~(hi < np.inf) | (hi == 0))
        if not bad.size:
            return
        r = int(bad[0])
        row = p[r]
        if np.isnan(row).any():
            what = f"NaN probability at expert {int(np.flatnonzero(np.isnan(row))[0])}"
        elif (row < 0).any():
            e = int(np.flatnonzero(row < 0)[0])
            what = f"negative probability {float(row[e])!r} at expert {e}"
        elif np.isinf(row).any():
            what = f"infinite probability at expert {int(np.flatnonzero(np.isinf(row))[0])}"
        else:
            what = "every probability is 0"
        raise TraceFormatError(self.path, what, self._where(record0 + r))

    def chunks(self, chunk_tokens: int) -> Iterator[TraceChunk]:
        """Logits (L, Tc, E) of consecutive tokens, read from disk chunk by chunk."""
        L, E = self.num_layers, self.num_experts
        buf = np.empty(min(chunk_tokens, self.num_tokens) * L, self._dtype)
        with open(self.path, "rb", buffering=0) as f:
            for t0, t1, start in stream_spans(self.streams, chunk_tokens):
                wanted = self._record[t0:t1].T.reshape(-1)  # (L * Tc,) layer-major
                order = np.argsort(wanted, kind="stable")
                recs = buf[: len(wanted)]
                self._read_records(f, wanted[order], recs)
                expected = np.repeat(self._tokens[t0:t1][None], L, axis=0).reshape(-1)[order]
                if not np.array_equal(recs["token"], expected):
                    raise TraceFormatError(self.path, "changed since it was checked")
                logits = np.empty((L * (t1 - t0), E), np.float32)
                logits[order] = recs["probs"]
                yield TraceChunk(
                    start, probabilities_to_logits(logits, out=logits).reshape(L, -1, E), None
                )

    def _read_records(self, f, sorted_records: np.ndarray, out: np.ndarray) -> None:
        """Read the given records (ascending) into `out`, one read per contiguous run."""
        starts = np.flatnonzero(np.r_[True, np.diff(sorted_records) != 1])
        ends = np.r_[starts[1:], len(sorted_records)]
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            first = int(sorted_records[a])
            f.seek(HEADER_BYTES + first * self._dtype.itemsize)
            self._read_into(f, out[a:b], first)

    def load(self) -> RouterTrace:
        """The whole trace in memory: logits (T, L, E) and their ranked top-k."""
        T, L, E = self.num_tokens, self.num_layers, self.num_experts
        logits = np.empty((T, L, E), np.float32)
        for (t0, t1, _), chunk in zip(
            stream_spans(self.streams, 4096), self.chunks(4096), strict=True
        ):
            logits[t0:t1] = chunk.logits.transpose(1, 0, 2)
        return RouterTrace(
            ids=ranked_topk(logits, self.top_k),
            logits=logits,
            num_experts=E,
            format=self.format,
            path=self.path,
            layers=self.layers,
            streams=self.streams,
            dropped_tokens=self.dropped_tokens,
        )
