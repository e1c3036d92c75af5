"""The co-activation table artefact (`results/{model}/coactivation.npz`).

Policies with `substitute_by="coactivation"` (docs/policy-semantics.md, v2) substitute a missed
expert with the resident most often selected together with it. The table is counted once per
model on the calibration split (`moesub.policy.coactivation`, counts summed over its streams),
never on the evaluation split the policies are measured on, and stored as one float64 array
`table` (L, E, E) beside the trace's `top_k` and `num_experts` (checked when it is read).
Simulate and emulate read it with `read_coactivation`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from moesub.artefacts import load_trace
from moesub.io import atomic_path
from moesub.policy import coactivation


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
