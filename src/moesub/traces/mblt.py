"""MBLT v1, mbolt's `MBOLT_TRACE` format: the top-k expert ids per layer.

A little-endian int32 stream: magic 0x544C424D (b"MBLT"), version 1, n_expert; then records
`layer, k, n_tokens, ids[n_tokens * k]` (token-major) in graph order, layers 0..L-1 per
forward pass. A pass starts where the layer number does not grow. Decode passes route one
token per layer; in a prefill pass llama.cpp's last layer may route only the last token, so
the pass's tokens are numbered by its widest record and a record of n rows holds the pass's
last n tokens (the rest are incomplete records: `moesub.traces.base`). The writer writes one
decode pass per token.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from moesub.traces.base import RouterTrace, TraceFormatError, check_id_rows, ids_trace, record_grid

MAGIC = 0x544C424D
MAGIC_BYTES = MAGIC.to_bytes(4, "little")  # b"MBLT"
VERSION = 1


def header(num_experts: int) -> np.ndarray:
    return np.array([MAGIC, VERSION, num_experts], "<i4")


def encode(ids: np.ndarray) -> np.ndarray:
    """int32 records of (T, L, k) ids: one decode pass per token."""
    T, L, k = ids.shape
    rec = np.empty((T, L, 3 + k), "<i4")
    rec[:, :, 0] = np.arange(L)[None, :]
    rec[:, :, 1] = k
    rec[:, :, 2] = 1
    rec[:, :, 3:] = ids
    return rec


def _offset(word: int) -> str:
    return f"offset {4 * word}"


def _records(path: Path, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per record its layer, n_tokens and header offset (int32 words); the ids (rows, k)."""
    n = len(raw)
    k = int(raw[4]) if n >= 6 else -1
    body = raw[3:]
    if k >= 1 and len(body) % (3 + k) == 0:  # decode-only files: every record (layer, k, 1, ids)
        rec = body.reshape(-1, 3 + k)
        if (rec[:, 1] == k).all() and (rec[:, 2] == 1).all():
            starts = 3 + np.arange(len(rec), dtype=np.int64) * (3 + k)
            return rec[:, 0].astype(np.int64), np.ones(len(rec), np.int64), starts, rec[:, 3:]
    layers, widths, starts, ids = [], [], [], []
    pos = 3
    while pos < n:
        if pos + 3 > n:
            raise TraceFormatError(
                path, f"truncated: a record header needs 3 int32, {n - pos} remain", _offset(pos)
            )
        layer, kr, nt = (int(v) for v in raw[pos : pos + 3])
        if kr < 1 or nt < 1 or layer < 0:
            raise TraceFormatError(
                path, f"bad record header: layer {layer}, k {kr}, n_tokens {nt}", _offset(pos)
            )
        if kr != k:
            raise TraceFormatError(
                path, f"inconsistent k: this record has k {kr}, the first has {k}", _offset(pos)
            )
        if pos + 3 + nt * kr > n:
            raise TraceFormatError(
                path,
                f"truncated: the record needs {nt * kr} ids, {n - pos - 3} int32 remain",
                _offset(pos),
            )
        layers.append(layer)
        widths.append(nt)
        starts.append(pos)
        ids.append(raw[pos + 3 : pos + 3 + nt * kr].reshape(nt, kr))
        pos += 3 + nt * kr
    return (
        np.array(layers, np.int64),
        np.array(widths, np.int64),
        np.array(starts, np.int64),
        np.concatenate(ids),
    )


def read_mblt(
    path: str | os.PathLike,
    top_k: int | None = None,
    num_experts: int | None = None,
    incomplete: str = "error",
) -> RouterTrace:
    path = Path(path)
    size = path.stat().st_size
    if size % 4:
        raise TraceFormatError(path, f"truncated: {size} bytes is not a whole number of int32")
    raw = np.fromfile(path, dtype="<i4")
    if len(raw) >= 1 and raw[0] != MAGIC:
        raise TraceFormatError(
            path, f"wrong magic {int(raw[0]) & 0xFFFFFFFF:#x}, expected {MAGIC:#x}", _offset(0)
        )
    if len(raw) < 3:
        raise TraceFormatError(path, f"truncated: {size} bytes, the header alone is 12")
    if raw[1] != VERSION:
        raise TraceFormatError(path, f"version {int(raw[1])}, expected {VERSION}", _offset(1))
    E = int(raw[2])
    if E < 1:
        raise TraceFormatError(path, f"n_expert {E} < 1", _offset(2))
    if num_experts is not None and num_experts != E:
        raise TraceFormatError(path, f"n_expert {E} in the header, but num_experts={num_experts}")
    if len(raw) == 3:
        raise TraceFormatError(path, "holds no records")
    layer, width, start, ids = _records(path, raw)
    k = ids.shape[1]
    if top_k is not None and top_k != k:
        raise TraceFormatError(path, f"records have k {k}, but top_k={top_k}")
    # passes: a new one wherever the layer number does not grow
    new_pass = np.r_[True, layer[1:] <= layer[:-1]]
    pass_of = np.cumsum(new_pass) - 1
    pass_width = np.maximum.reduceat(width, np.flatnonzero(new_pass))  # tokens per pass
    pass_token0 = np.r_[0, np.cumsum(pass_width)[:-1]]
    # one row per (record, token): the record's n rows are its pass's last n tokens
    rec_of_row = np.repeat(np.arange(len(layer)), width)
    first_row = np.r_[0, np.cumsum(width)[:-1]]
    j = np.arange(len(rec_of_row)) - first_row[rec_of_row]  # row within its record
    p = pass_of[rec_of_row]
    token = pass_token0[p] + pass_width[p] - width[rec_of_row] + j

    def where(row: int) -> str:
        return f"record at {_offset(int(start[rec_of_row[row]]))}, row {int(j[row])}"

    check_id_rows(path, ids, E, where)
    grid = record_grid(path, token, layer[rec_of_row], where, incomplete)
    return ids_trace(path, "mblt", ids, grid, E)
