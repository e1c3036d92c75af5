"""Reading any trace format (named or told from the content) and writing RTRACE01 / MBLT.

`open_trace` checks a whole file before anything else reads it and returns what the chunked
simulation takes: an RTRACE01 file stays on disk (`Rtrace01File`), every other format is read
into a `RouterTrace`. `read_trace` always returns the `RouterTrace`. Writers go through
`moesub.io.atomic_path`: the file appears complete or not at all.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from moesub.artefacts import load_trace
from moesub.io import AtomicWriter
from moesub.traces import mblt, rtrace01
from moesub.traces.base import RouterTrace, TraceFormatError, check_id_rows, ranked_topk
from moesub.traces.expert_log import PREFIX, read_expert_log
from moesub.traces.mblt import read_mblt
from moesub.traces.rtrace01 import Rtrace01File

FORMATS = ("rtrace01", "mblt", "expert_log", "moesub")
WRITE_FORMATS = ("rtrace01", "mblt")
SNIFF_BYTES = 1 << 20  # how much of a text file is searched for an expert-log line


def detect_format(path: str | os.PathLike) -> str:
    """The format of a trace file, from its first bytes (an expert log: a line starting with
    `EXPERT|` in its first MiB)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if head.startswith(rtrace01.MAGIC):
        return "rtrace01"
    if head.startswith(mblt.MAGIC_BYTES):
        return "mblt"
    if head.startswith(b"PAR1"):
        return "moesub"
    text = head.decode("utf-8", errors="replace")
    if any(line.lstrip().startswith(PREFIX) for line in text.splitlines()):
        return "expert_log"
    raise TraceFormatError(
        path, f"cannot tell the format from the first bytes {head[:8]!r}; expected one of {FORMATS}"
    )


def read_moesub(
    path: Path, top_k: int | None = None, num_experts: int | None = None
) -> RouterTrace:
    """moesub's own captured router table (`moesub.artefacts.load_trace`), streams kept."""
    try:
        trace = load_trace(path)
    except ValueError as e:
        raise TraceFormatError(path, str(e)) from e
    for name, given, have in (
        ("top_k", top_k, trace.top_k),
        ("num_experts", num_experts, trace.num_experts),
    ):
        if given is not None and given != have:
            raise TraceFormatError(path, f"metadata has {name} {have}, but {name}={given}")
    logits = np.concatenate(trace.logits)
    return RouterTrace(
        ids=ranked_topk(logits, trace.top_k),
        logits=logits,
        num_experts=trace.num_experts,
        format="moesub",
        path=path,
        layers=tuple(range(trace.num_layers)),
        streams=tuple(z.shape[0] for z in trace.logits),
        meta=trace.meta,
    )


def open_trace(
    path: str | os.PathLike,
    format: str | None = None,
    *,
    top_k: int | None = None,
    num_experts: int | None = None,
    incomplete: str = "error",
) -> RouterTrace | Rtrace01File:
    """Check a whole trace file; RTRACE01 stays on disk (read in chunks), the rest is loaded.

    `top_k` is required for RTRACE01 (the file does not record it) and checked against the
    others; `num_experts` is checked against the file (an expert log takes it from here, else
    from its largest id). `incomplete`: "error" or "drop" (`moesub.traces.base`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    fmt = detect_format(path) if format is None else format
    if fmt == "rtrace01":
        f = Rtrace01File(path, top_k, incomplete)
        if num_experts is not None and num_experts != f.num_experts:
            raise TraceFormatError(
                path, f"n_experts {f.num_experts}, but num_experts={num_experts}"
            )
        return f
    if fmt == "mblt":
        return read_mblt(path, top_k, num_experts, incomplete)
    if fmt == "expert_log":
        return read_expert_log(path, top_k, num_experts, incomplete)
    if fmt == "moesub":
        return read_moesub(path, top_k, num_experts)
    raise ValueError(f"format: unknown trace format {fmt!r}; expected one of {FORMATS} or None")


def read_trace(
    path: str | os.PathLike,
    format: str | None = None,
    *,
    top_k: int | None = None,
    num_experts: int | None = None,
    incomplete: str = "error",
) -> RouterTrace:
    """The whole trace in memory (`open_trace`'s arguments)."""
    return open_trace(
        path, format, top_k=top_k, num_experts=num_experts, incomplete=incomplete
    ).load()


class TraceWriter(AtomicWriter):
    """Writes a trace token chunk by token chunk; the file appears (atomically) on close.

    "rtrace01" takes logits (T, L, E) float32 and writes their softmax; "mblt" takes ids
    (T, L, k), or logits and `top_k` (their ranked top-k). Every call must have the same L.
    """

    def __init__(
        self, path: str | os.PathLike, fmt: str, num_experts: int, top_k: int | None = None
    ) -> None:
        if fmt not in WRITE_FORMATS:
            raise ValueError(f"fmt: cannot write {fmt!r}; expected one of {WRITE_FORMATS}")
        if not 1 <= num_experts <= rtrace01.MAX_EXPERTS:
            raise ValueError(f"num_experts: {num_experts} is not in [1, {rtrace01.MAX_EXPERTS}]")
        self.fmt, self.num_experts, self.top_k = fmt, num_experts, top_k
        self.tokens, self.num_layers = 0, None
        super().__init__(path)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in _close_output)
        head = (
            rtrace01.header(num_experts)
            if fmt == "rtrace01"
            else mblt.header(num_experts).tobytes()
        )
        self._file.write(head)

    def write(self, *, logits: np.ndarray | None = None, ids: np.ndarray | None = None) -> None:
        """Append T tokens: logits float32 (T, L, E) and/or (mblt) ids (T, L, k)."""
        if self.fmt == "rtrace01":
            if logits is None or ids is not None:
                raise ValueError("rtrace01 holds probabilities: pass logits (T, L, E), not ids")
            self._check_layers(self._check_logits(logits).shape[1])
            self._file.write(rtrace01.encode(logits, self.tokens).tobytes())
            self.tokens += logits.shape[0]
            return
        if (logits is None) == (ids is None):
            raise ValueError("mblt: pass either ids (T, L, k) or logits (T, L, E) with top_k")
        if logits is not None:
            if self.top_k is None:
                raise ValueError("mblt from logits: the writer needs top_k")
            ids = ranked_topk(self._check_logits(logits), self.top_k)
        ids = np.asarray(ids)
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids: expected integer (T, L, k), got {ids.dtype} {ids.shape}")
        if self.top_k is not None and ids.shape[2] != self.top_k:
            raise ValueError(f"ids: k {ids.shape[2]}, but the writer has top_k {self.top_k}")
        self._check_layers(ids.shape[1])
        check_id_rows(
            self.path, ids.reshape(-1, ids.shape[2]), self.num_experts, lambda r: f"row {r}"
        )
        self._file.write(mblt.encode(ids).tobytes())
        self.tokens += ids.shape[0]

    def _check_logits(self, logits: Any) -> np.ndarray:
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.ndim != 3:
            raise ValueError("logits: expected a float32 numpy array (T, L, E)")
        if logits.shape[2] != self.num_experts:
            raise ValueError(
                f"logits: {logits.shape[2]} experts, the writer has {self.num_experts}"
            )
        if not np.isfinite(logits).all():
            bad = tuple(np.argwhere(~np.isfinite(logits))[0].tolist())
            raise ValueError(f"logits: NaN or inf (first at index {bad})")
        return logits

    def _check_layers(self, L: int) -> None:
        if L < 1:
            raise ValueError("a trace needs at least one layer")
        if self.num_layers is not None and self.num_layers != L:
            raise ValueError(f"{L} layers, but earlier tokens have {self.num_layers}")
        self.num_layers = L

    def _close_output(self) -> None:
        self._file.close()

    def close(self) -> None:
        if self.tokens == 0:
            self.abort()
            raise ValueError(f"trace {str(self.path)!r}: no tokens written; nothing was written")
        super().close()


def write_trace(
    path: str | os.PathLike,
    fmt: str,
    *,
    logits: np.ndarray | None = None,
    ids: np.ndarray | None = None,
    top_k: int | None = None,
    num_experts: int | None = None,
) -> Path:
    """Write a whole trace: "rtrace01" from logits (T, L, E); "mblt" from ids (T, L, k) (with
    `num_experts`) or from logits and `top_k`. Atomic: checks fail before the file appears."""
    E = logits.shape[-1] if logits is not None else num_experts
    if E is None:
        raise ValueError(
            "write_trace: ids alone do not say the number of experts; pass num_experts"
        )
    with TraceWriter(path, fmt, int(E), top_k) as w:
        w.write(logits=logits, ids=ids)
    return Path(path)
