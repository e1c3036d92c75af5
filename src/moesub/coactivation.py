"""The co-activation table artefact (`results/{model}/coactivation.npz`).

Policies with `substitute_by="coactivation"` (docs/policy-semantics.md, v2) substitute a missed
expert with the resident most often selected together with it. The table is counted once per
model on the calibration split (`moesub.coactivation.coactivation`, counts summed over its streams),
never on the evaluation split the policies are measured on, and stored as one float64 array
`table` (L, E, E) beside the trace's `top_k` and `num_experts` (checked when it is read).
Simulate and emulate read it with `read_coactivation`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from moesub import _core
from moesub.artefacts import load_trace
from moesub.io import atomic_path
from moesub.policy import check_logits, check_sizes


def coactivation(logits: np.ndarray | list[np.ndarray], k: int) -> np.ndarray:
    """The co-activation table of a trace (docs/policy-semantics.md, v2 `substitute_by`).

    `logits`: one float32 (T, L, E) trace or a list of streams of one model. Returns float64
    (L, E, E): A[l, e, c] = (tokens with e and c both in layer l's top-k) / max(1, tokens with e
    in it), the top-k with v1's ties (lower id). The diagonal is 1 for an expert ever selected.
    """
    streams = [logits] if isinstance(logits, np.ndarray) else list(logits)
    if not streams:
        raise ValueError("coactivation: need at least one router-logit stream")
    # the core checks for NaN/inf as it reads the logits, as in scan
    streams = [check_logits(s, 3, finite=False) for s in streams]
    shapes = {s.shape[1:] for s in streams}
    if len(shapes) != 1:
        raise ValueError(f"coactivation: all streams need the same (L, E); got {sorted(shapes)}")
    L, E = streams[0].shape[1:]
    check_sizes(E, k, E)
    counts = np.zeros((L, E, E), np.int64)
    for s in streams:
        _core.coactivation_counts(s, k, counts)
    selected = np.diagonal(counts, axis1=1, axis2=2)  # (L, E): tokens with e in the top-k
    return counts / np.maximum(1, selected)[:, :, None]


def write_coactivation(calib_router_path: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """Count the co-activation table of a calibration router trace and write it (atomically)."""
    trace = load_trace(calib_router_path)
    table = coactivation(trace.logits, trace.top_k)
    with atomic_path(out_path, suffix=".npz") as tmp, open(tmp, "wb") as f:
        # a file object: np.savez would append ".npz" to a path not ending in it
        np.savez_compressed(
            f,
            table=table,
            top_k=np.int64(trace.top_k),
            num_experts=np.int64(trace.num_experts),
            source=np.str_(str(calib_router_path)),
        )


def read_coactivation(
    path: str | os.PathLike, num_layers: int | None = None, num_experts: int | None = None
) -> np.ndarray:
    """The float64 (L, E, E) table of a coactivation artefact, checked against the expected
    geometry (None: not checked)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"coactivation table {str(path)!r} does not exist")
    with np.load(path, allow_pickle=False) as z:
        if "table" not in z.files:
            raise ValueError(f"coactivation table {str(path)!r}: no 'table' array in {z.files}")
        table = z["table"]
    if table.dtype != np.float64 or table.ndim != 3 or table.shape[1] != table.shape[2]:
        raise ValueError(
            f"coactivation table {str(path)!r}: expected float64 (L, E, E), got {table.dtype} "
            f"{table.shape}"
        )
    L, E = table.shape[:2]
    if (num_layers is not None and num_layers != L) or (
        num_experts is not None and num_experts != E
    ):
        raise ValueError(
            f"coactivation table {str(path)!r}: shape {table.shape} does not match the trace's "
            f"{num_layers} layers x {num_experts} experts (counted for another model?)"
        )
    return table
