"""Expert-log lines, as a patched llama.cpp writes them to stderr with `LLAMA_EXPERT_LOG=1` and
moe-l2 reads them: `EXPERT|L<layer>|T<token>: [id, id, ...]`, one line per (token, layer).

Lines that do not start with `EXPERT|` (the rest of a server's log) are skipped. moe-l2's own
parsers also accept several bracketed lists on one line and count them all as activations;
which token each list belongs to is not defined anywhere we could read, so such a line is an
error here. The log does not record the number of experts: the caller passes it, else it is
taken as the largest id + 1 (`meta["num_experts_inferred"]`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from moesub.traces.base import RouterTrace, TraceFormatError, check_id_rows, ids_trace, record_grid

PREFIX = "EXPERT|"
LINE = re.compile(r"EXPERT\|L(\d+)\|T(\d+):\s*\[([^\[\]]*)\]")


def read_expert_log(
    path: str | os.PathLike,
    top_k: int | None = None,
    num_experts: int | None = None,
    incomplete: str = "error",
) -> RouterTrace:
    path = Path(path)
    tokens, layers, rows, lines = [], [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, text in enumerate(f, 1):
            s = text.strip()
            if not s.startswith(PREFIX):
                continue
            m = LINE.fullmatch(s)
            if m is None:
                lists = s.count("[")
                problem = (
                    f"holds {lists} bracketed id lists; one line per (token, layer) is read"
                    if lists > 1
                    else "not of the form EXPERT|L<layer>|T<token>: [id, id, ...]"
                )
                raise TraceFormatError(path, f"{problem}: {s[:80]!r}", f"line {lineno}")
            try:
                ids = [int(x) for x in m.group(3).split(",")]
            except ValueError:
                raise TraceFormatError(
                    path, f"expert ids are not integers: {s[:80]!r}", f"line {lineno}"
                ) from None
            if rows and len(ids) != len(rows[0]):
                raise TraceFormatError(
                    path,
                    f"inconsistent k: {len(ids)} ids, line {lines[0]} has {len(rows[0])}",
                    f"line {lineno}",
                )
            layers.append(int(m.group(1)))
            tokens.append(int(m.group(2)))
            rows.append(ids)
            lines.append(lineno)
    if not rows:
        raise TraceFormatError(path, f"holds no line starting with {PREFIX!r}")
    ids = np.array(rows, np.int64)  # (n, k)
    k = ids.shape[1]
    if top_k is not None and top_k != k:
        raise TraceFormatError(path, f"lines hold {k} ids, but top_k={top_k}")

    def where(r: int) -> str:
        return f"line {lines[r]}"

    inferred = num_experts is None
    E = int(ids.max()) + 1 if inferred else int(num_experts)
    check_id_rows(path, ids, E, where)
    grid = record_grid(
        path, np.array(tokens, np.int64), np.array(layers, np.int64), where, incomplete
    )
    return ids_trace(path, "expert_log", ids, grid, E, {"num_experts_inferred": inferred})
