"""Experiment B: does the *composition* of substitutions matter at equal substituted mass?

Forced-substitution emulation. Every expert is available (no cache dynamics); per token and MoE
layer, among the selected experts of rank 2..k (the first choice is never substituted) a fixed
share of gate mass, at most the target `m*`, is substituted in one of two compositions:

- **heavy**: the single expert with the largest weight <= m* (none if no weight is <= m*; among
  equal weights the better rank);
- **light**: the longest run of the lowest-weight experts, taken in ascending weight order (ties:
  the worse rank first), whose weights sum to <= m*, only if that run has at least 2 experts.

Everything else is computed exactly. A substitute is chosen by the policy core
(`moesub.policy.forced_substitution`: highest logit among resident experts not in this token's
computed set) from a configurable resident set (default: the frequency-initial set at the
configured fraction). The realized mass per token-layer is recorded: it falls short of m* whenever
no eligible composition exists, and the analysis must see by how much.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from moesub.capture import read_initial_set
from moesub.emulate import (
    capacity_for,
    check_initial,
    check_replay_options,
    check_token_table,
    computed_ids,
    iter_streams,
    load_for_capture,
    model_device,
    require_file,
)
from moesub.io import write_parquet
from moesub.models import RouterHook, moe_info, stream_nll
from moesub.params import options_from, torch_device
from moesub.policy import CORE_BUILD_ID, forced_substitution

CONDITIONS = ("heavy", "light")


# --------------------------------------------------------------------------- selection (numpy)
def _check_weights(weights: np.ndarray, target_mass: float) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] < 1:
        raise ValueError(f"weights must be (N, k) with k >= 1, got shape {w.shape}")
    if not np.isfinite(target_mass) or target_mass < 0:
        raise ValueError(f"target_mass must be a finite number >= 0, got {target_mass!r}")
    return w


def select_heavy(weights: np.ndarray, target_mass: float) -> np.ndarray:
    """(N, k) bool: the single rank >= 2 with the largest weight <= m* (ties: better rank)."""
    w = _check_weights(weights, target_mass)
    n, k = w.shape
    mask = np.zeros((n, k), dtype=bool)
    if k < 2:
        return mask
    tail = w[:, 1:]  # ranks 2..k
    eligible = tail <= target_mass
    score = np.where(eligible, tail, -np.inf)
    best = np.argmax(score, axis=1)  # first maximum = better rank among ties
    rows = np.flatnonzero(eligible.any(axis=1))
    mask[rows, best[rows] + 1] = True
    return mask


def select_light(weights: np.ndarray, target_mass: float) -> np.ndarray:
    """(N, k) bool: the longest ascending-weight run of ranks >= 2 whose sum is <= m*, if >= 2
    experts long (ties in weight: the worse rank joins the run first)."""
    w = _check_weights(weights, target_mass)
    n, k = w.shape
    mask = np.zeros((n, k), dtype=bool)
    if k < 3:
        return mask
    tail = w[:, 1:]  # (N, k-1) ranks 2..k
    # ascending weight; among equal weights the worse (higher) rank first
    worse_first = np.broadcast_to(-np.arange(tail.shape[1]), tail.shape)
    order = np.lexsort((worse_first, tail), axis=1)  # primary key: weight; then worse rank
    sorted_w = np.take_along_axis(tail, order, axis=1)
    run = (np.cumsum(sorted_w, axis=1) <= target_mass).sum(axis=1)  # prefix sums are monotone
    take = (np.arange(tail.shape[1])[None, :] < run[:, None]) & (run[:, None] >= 2)
    sub_tail = np.zeros_like(take)
    np.put_along_axis(sub_tail, order, take, axis=1)
    mask[:, 1:] = sub_tail
    return mask


def select_substitutions(weights: np.ndarray, condition: str, target_mass: float) -> np.ndarray:
    """The Experiment B substitution mask (N, k) for `condition` in {"heavy", "light"}."""
    if condition == "heavy":
        return select_heavy(weights, target_mass)
    if condition == "light":
        return select_light(weights, target_mass)
    raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")


def substitute(
    z: np.ndarray, k: int, resident: np.ndarray, mask: np.ndarray, selected: np.ndarray
) -> np.ndarray:
    """Computed ids (N, k): the ranks in `mask` replaced by the core's substitute choice (a
    selected expert is never a candidate: neither its own substitute nor another rank's)."""
    ids, _, sel = forced_substitution(z, k, resident, mask)
    if not np.array_equal(sel, selected):
        raise RuntimeError("forced_substitution selected different experts for the same logits")
    return ids


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class ExpBParams:
    """The `expb:` section of config.yaml (every key optional)."""

    fraction: float = 0.25  # resident set = frequency-initial set at this fraction
    resident: str = "initial"  # "initial" | "all" (every expert may serve as a substitute)
    progress: bool = True
    max_streams: int | None = None
    dtype: str | None = None  # float32 | bfloat16 | float16; None = the capture's dtype
    device: str = "cpu"  # torch device, or "auto" (cuda if available)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> ExpBParams:
        out = options_from(cls, params, "expb")
        if out.resident not in ("initial", "all"):
            raise ValueError(f"params.resident must be 'initial' or 'all', got {out.resident!r}")
        if not isinstance(out.fraction, (int, float)) or not 0.0 < float(out.fraction) <= 1.0:
            raise ValueError(f"params.fraction must be in (0, 1], got {out.fraction!r}")
        check_replay_options(out.max_streams, out.dtype)
        return out


# --------------------------------------------------------------------------- router callback
@dataclass
class ForcedRouter:
    """RouterHook callback: substitute the condition's experts at every layer via the core."""

    resident: np.ndarray  # (L, C) int32 experts that may serve as substitutes
    condition: str
    target_mass: float
    k: int
    _mass: list[list[np.ndarray]] = field(default_factory=list)
    _nsub: list[list[np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._mass = [[] for _ in range(len(self.resident))]
        self._nsub = [[] for _ in range(len(self.resident))]

    def decide(self, layer: int, z: np.ndarray):
        """Core decisions for logits z (N, E) float32: (ids, selected, realized mass, n_sub)."""
        none = np.zeros((z.shape[0], self.k), dtype=bool)
        _, weights, selected = forced_substitution(z, self.k, self.resident[layer], none)
        mask = select_substitutions(weights, self.condition, self.target_mass)
        ids = substitute(z, self.k, self.resident[layer], mask, selected)
        done = mask & (ids != selected)
        realized = np.where(done, weights, 0.0).sum(axis=1)
        return ids, selected, realized, done.sum(axis=1)

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        z = np.ascontiguousarray(logits.detach().to(torch.float32).cpu().numpy())  # (N, E)
        new_ids, selected, realized, n_sub = self.decide(layer, z)
        self._mass[layer].append(realized)
        self._nsub[layer].append(n_sub)
        return computed_ids(ids, selected, new_ids, logits)

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """(realized mass (T, L) float64, substitutions (T, L) int) since the last take."""
        mass = np.stack([np.concatenate(m) for m in self._mass], axis=1)
        nsub = np.stack([np.concatenate(n) for n in self._nsub], axis=1)
        self._reset()
        return mass, nsub


def expb_streams(
    model,
    token_table: Any,
    condition: str,
    target_mass: float,
    resident: np.ndarray,
    progress: bool = True,
    max_streams: int | None = None,
) -> tuple[pl.DataFrame, np.ndarray]:
    """Forced-substitution emulation of every stream: (per-token table, realized (N_tok, L)).

    Columns: `stream, pos, doc_id, doc_start, nll, mass` (realized substituted mass, summed over
    layers), `n_sub` (substituted experts, summed over layers), `layer_mass` list[L] (realized
    mass per token-layer)."""
    info = moe_info(model)
    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
    df = check_token_table(token_table, info.vocab_size)
    resident = np.asarray(resident)
    if resident.ndim != 2 or resident.shape[0] != info.num_layers:
        raise ValueError(
            f"resident set has shape {resident.shape}, the model needs (L={info.num_layers}, C)"
        )
    resident = check_initial(resident, info.num_layers, info.num_experts, resident.shape[1])
    if resident.shape[1] < 2 * info.top_k - 1:
        raise ValueError(
            f"resident set of {resident.shape[1]} experts per layer is too small for k="
            f"{info.top_k}: every substituted rank needs a candidate (C >= 2k - 1)"
        )
    router = ForcedRouter(resident, condition, float(target_mass), info.top_k)
    frames, realized = [], []
    streams = list(iter_streams(df))[:max_streams]
    bar = tqdm(streams, desc=f"expb {condition}", unit="stream", disable=not progress)
    for _stream, rows in bar:
        input_ids = torch.as_tensor(rows["token_id"].to_numpy().astype(np.int64)).view(1, -1)
        with RouterHook(model, router):
            nll = stream_nll(model, input_ids.to(model_device(model)))[0]
        mass, nsub = router.take()
        realized.append(mass)
        frames.append(
            rows.select(
                pl.col("stream").cast(pl.Int32),
                pl.col("pos").cast(pl.Int32),
                pl.col("doc_id").cast(pl.Int32),
                pl.col("doc_start").cast(pl.Boolean),
            )
            .with_columns(
                pl.Series("nll", np.asarray(nll, np.float64), dtype=pl.Float64).fill_nan(None),
                pl.Series("mass", mass.sum(axis=1), dtype=pl.Float64),
                pl.Series("n_sub", nsub.sum(axis=1), dtype=pl.Int32),
                pl.Series("layer_mass", mass, dtype=pl.Array(pl.Float64, mass.shape[1])),
            )
            .with_columns(pl.col("layer_mass").cast(pl.List(pl.Float64)))
        )
    return pl.concat(frames), np.concatenate(realized)


def run_expb(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    initial_sets_path: str | os.PathLike,
    condition: str,
    target_mass: float,
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> Path:
    """One Experiment B condition at one target mass -> per-token Parquet at `out_path`.

    Metadata: condition, target_mass, realized mass per token-layer (mean, and the share of
    token-layers with any substitution), resident-set source, fraction, capacity.
    """

    require_file(model_dir, "model_dir")
    tokens_path = require_file(tokens_path, "tokens_path")
    opts = ExpBParams.from_dict(params)
    if opts.resident == "initial":
        initial_sets_path = require_file(initial_sets_path, "initial_sets_path")
    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
    if not isinstance(target_mass, (int, float)) or not 0.0 < float(target_mass) < 1.0:
        raise ValueError(f"target_mass must be a number in (0, 1), got {target_mass!r}")

    model, info, tokens, dtype = load_for_capture(
        model_dir, tokens_path, opts.dtype, torch_device(opts.device)
    )
    if opts.resident == "all":
        resident = np.tile(np.arange(info.num_experts, dtype=np.int32), (info.num_layers, 1))
        capacity = info.num_experts
    else:
        capacity = capacity_for(opts.fraction, info.num_experts, info.top_k)
        resident = check_initial(
            read_initial_set(initial_sets_path, opts.fraction),
            info.num_layers,
            info.num_experts,
            capacity,
        )
    out, realized = expb_streams(
        model,
        tokens,
        condition,
        float(target_mass),
        resident,
        progress=opts.progress,
        max_streams=opts.max_streams,
    )
    meta = {
        "condition": condition,
        "target_mass": float(target_mass),
        "realized_mass_mean": float(realized.mean()),
        "realized_share_substituted": float((realized > 0).mean()),
        "resident": opts.resident,
        "fraction": float(opts.fraction) if opts.resident == "initial" else 1.0,
        "capacity": capacity,
        "num_layers": info.num_layers,
        "core_build_id": CORE_BUILD_ID,
        "dtype": dtype,
    }
    return write_parquet(out, out_path, metadata=meta)
