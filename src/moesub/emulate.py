"""Exact emulation of a model under a cache/substitution policy (stage 4 of docs/architecture.md).

The model is recomputed with teacher forcing over each token stream. At every MoE layer a router
hook hands that layer's logits for the whole stream to the policy core (`moesub.policy.LayerCache`,
one cache per layer, fresh from the initial resident set for every stream), and the experts are
computed with the ids the core returns (a substitute in SUB slots, the original expert otherwise).

This *layer-major* form is exact: caches are per layer (each with its own capacity, initial
experts and pins: the layout, `moesub.artefacts.layout_for`), and a token's routing at layer
`l` depends only on earlier tokens (at every layer) and on earlier layers (for the same
token), all of which are already final when layer `l` runs over the whole stream. The v2 fields
replay too: prefetch steps the caches with lookahead logits the hook recomputes from the
emulated hidden states (not the captured ones: substitution changes them), route_bias computes
the core's selection, light_miss='host' computes the expert as normal (lossless),
substitute_by='coactivation' takes the model's co-activation table. Eviction 'belady' is
offline-only and rejected.
`emulate_token_by_token` decodes one token at a time with the KV cache instead; it is kept only
as the test oracle for that argument.
The routers, cache set-up, model loading and greedy decoding this shares with Experiment B and
generation are `moesub.replay`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from moesub.artefacts import check_token_table, iter_streams, layout_for
from moesub.coactivation import read_coactivation
from moesub.config import schema_defaults
from moesub.io import read_metadata, require_file, write_parquet
from moesub.metrics import dppl_pct
from moesub.models import ModelLoading, input_device, moe_info, stream_batches, stream_nll
from moesub.params import options_from, torch_device
from moesub.policy import CORE_BUILD_ID, STATUS_NAMES
from moesub.replay import (
    BatchRouter,
    StreamTrace,
    check_run,
    forward_step,
    load_for_capture,
    policy_router,
    replay_policy,
    router_context,
)
from moesub.slots import policy_fields

# --------------------------------------------------------------------------- configuration
_DEFAULTS = schema_defaults("emulate")  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class EmulateParams:
    """The `emulate:` section of config.yaml (every key optional)."""

    progress: bool = True  # tqdm over streams
    # emulate only the first n streams (smoke runs)
    max_streams: int | None = _DEFAULTS["max_streams"]
    # float32 | bfloat16 | float16; None = the capture's dtype
    dtype: str | None = _DEFAULTS["dtype"]
    device: str = _DEFAULTS["device"]  # torch device, or "auto" (cuda if available)
    # the model's placement (config `models.<name>.loading`, added by the workflow)
    loading: ModelLoading | Mapping[str, Any] | None = field(default_factory=ModelLoading)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> EmulateParams:
        out = options_from(cls, params, "emulate", section="emulate")
        return replace(out, loading=ModelLoading.from_dict(out.loading))


# --------------------------------------------------------------------------- layer-major emulation
def emulate_batch(
    model, ids: np.ndarray, policy, capacity, initial=None, record=False, coactivation=None
) -> list[StreamTrace]:
    """Layer-major emulation of B equal-length streams `ids` (B, T) in one teacher-forced
    forward (`stream_nll`); every stream has its own fresh per-layer caches (`capacity` and
    `initial` per layer or for all: `moesub.replay.make_caches`). `coactivation`: the
    (L, E, E) table substitute_by='coactivation' needs."""
    ids = np.asarray(ids, dtype=np.int64)
    routers = [
        policy_router(model, policy, capacity, initial, coactivation, record=record) for _ in ids
    ]
    with router_context(model, BatchRouter(routers)):
        nll = stream_nll(model, torch.from_numpy(ids))  # (B, T)
    return [r.take(row) for r, row in zip(routers, nll, strict=True)]


def emulate_stream(
    model,
    ids: Sequence[int] | np.ndarray,
    policy,
    capacity,
    initial=None,
    record=False,
    coactivation=None,
) -> StreamTrace:
    """Layer-major emulation of one stream (a batch of one)."""
    ids = np.asarray(ids, dtype=np.int64)[None]  # (1, T)
    return emulate_batch(model, ids, policy, capacity, initial, record, coactivation)[0]


def emulate_streams(
    model,
    token_table: Any,
    policy,
    capacity: int | Sequence[int],
    initial: Any = None,
    progress: bool = True,
    max_streams: int | None = None,
    batch_tokens: int | None = None,
    coactivation: np.ndarray | None = None,
) -> pl.DataFrame:
    """Emulate every stream of a token table under `policy`; one row per token.

    Columns: `stream, pos, doc_id, doc_start, nll, mass (sum over layers), layer_mass list[L],
    hit, fetch, sub, host, forced` (slot counts summed over layers), `prefetches` (experts
    inserted by prefetch, summed over layers: the simulator's counter of that name, per token).
    Each stream starts from a fresh cache per layer holding its `initial` set (an (L, C) array
    or L per-layer sets of the per-layer `capacity`: `moesub.replay.make_caches`). Streams are
    batched as the capture batched them (`batch_tokens`, from the capture's metadata; None = one
    stream per forward), which bit-identical NLL needs.
    """

    info = moe_info(model)
    policy = replay_policy(policy)
    df = check_token_table(token_table, info.vocab_size)
    streams = [rows for _stream, rows in iter_streams(df)][:max_streams]
    frames = []
    bar = tqdm(total=len(streams), desc="emulate", unit="stream", disable=not progress)
    for batch in stream_batches([r.height for r in streams], batch_tokens):
        ids = np.stack([streams[i]["token_id"].to_numpy() for i in batch])  # (B, T)
        for i, trace in zip(
            batch,
            emulate_batch(model, ids, policy, capacity, initial, coactivation=coactivation),
            strict=True,
        ):
            frames.append(
                stream_frame(streams[i], trace.nll, trace.mass, trace.counts, trace.prefetched)
            )
        bar.update(len(batch))
    bar.close()
    return pl.concat(frames)


def stream_frame(
    rows: pl.DataFrame,
    nll: np.ndarray,
    layer_mass: np.ndarray,
    counts: np.ndarray,
    prefetched: np.ndarray,
) -> pl.DataFrame:
    """Per-token output rows of one stream (the emulate schema); `prefetched` (T, L)."""
    num_layers = layer_mass.shape[1]
    out = rows.select(
        pl.col("stream").cast(pl.Int32),
        pl.col("pos").cast(pl.Int32),
        pl.col("doc_id").cast(pl.Int32),
        pl.col("doc_start").cast(pl.Boolean),
    ).with_columns(
        pl.Series("nll", nll, dtype=pl.Float64).fill_nan(None),
        pl.Series("mass", layer_mass.sum(axis=1), dtype=pl.Float64),
        pl.Series("layer_mass", layer_mass, dtype=pl.Array(pl.Float64, num_layers)),
        *[
            pl.Series(name, counts[:, code], dtype=pl.Int32)
            for code, name in enumerate(STATUS_NAMES)
        ],
        pl.Series("prefetches", prefetched.sum(axis=1), dtype=pl.Int32),
    )
    return out.with_columns(pl.col("layer_mass").cast(pl.List(pl.Float64)))


# --------------------------------------------------------------------------- token-by-token
@torch.inference_mode()
def emulate_token_by_token(
    model, ids: Sequence[int] | np.ndarray, policy, capacity, initial=None, coactivation=None
) -> StreamTrace:
    """Test oracle: teacher-forced decoding one token at a time with the KV cache, the core
    called per token and layer. Must equal `emulate_stream` (ids, status, NLL)."""
    router = policy_router(model, policy, capacity, initial, coactivation, record=True)
    ids = np.asarray(ids, dtype=np.int64)
    device = input_device(model)
    nll = np.full(len(ids), np.nan)
    cache = None
    with router_context(model, router):
        for t in range(len(ids)):
            step = torch.tensor([[ids[t]]], dtype=torch.long, device=device)
            logits, cache = forward_step(model, step, cache)
            if t + 1 < len(ids):
                logp = torch.log_softmax(logits, dim=-1)
                nll[t + 1] = -float(logp[int(ids[t + 1])])
    return router.take(nll)


# --------------------------------------------------------------------------- stage entry point
def run_emulate(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    size: float | Mapping[str, Any],
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
    coactivation_path: str | os.PathLike | None = None,
    allocation_path: str | os.PathLike | None = None,
) -> Path:
    """Emulate one (model, policy, size): per-token Parquet (emulate schema) at `out_path`.

    `policy`: the config's policy dict (pin spec, allocation); `size`: a resolved cache size
    (`moesub.layout.CacheSize.to_dict`) or a fraction; the layout comes from the expert ranking
    at `ranking_path` (and a planned policy's `allocation_path`). Every input is checked before
    the model runs: the policy (an offline eviction is rejected), the size, the token ids
    against the model's vocabulary, the ranking against the model's L/E and the layout's
    capacities and pins, and the co-activation table (`coactivation_path`, the model's
    coactivation.npz: required by, and only read for, substitute_by='coactivation').
    """

    require_file(model_dir, "model_dir")
    tokens_path = require_file(tokens_path, "tokens_path")
    ranking_path = require_file(ranking_path, "ranking_path")
    check_run(name, size)
    replay_policy(policy_fields(policy))
    opts = EmulateParams.from_dict(params)
    table = None
    if policy.get("substitute_by") == "coactivation":
        if coactivation_path is None:
            raise ValueError(
                f"policy {name!r}: substitute_by='coactivation' needs the co-activation table "
                "(coactivation_path: the model's coactivation.npz)"
            )
        table = read_coactivation(require_file(coactivation_path, "coactivation_path"))

    model, info, tokens, dtype = load_for_capture(
        model_dir, tokens_path, opts.dtype, torch_device(opts.device), opts.loading
    )
    layout = layout_for(
        ranking_path, size, policy, info.top_k, info.num_layers, info.num_experts,
        allocation_path,
    )  # fmt: skip
    if table is not None:
        table = read_coactivation(coactivation_path, info.num_layers, info.num_experts)
    out = emulate_streams(
        model,
        tokens,
        layout.policy(policy),
        layout.capacities,
        layout.initial,
        progress=opts.progress,
        max_streams=opts.max_streams,
        batch_tokens=read_metadata(tokens_path).get("batch_tokens"),
        coactivation=table,
    )
    meta = {
        **layout.run_metadata(name, policy),
        "core_build_id": CORE_BUILD_ID,
        "num_layers": info.num_layers,
        "dtype": dtype,
        **({"coactivation": str(coactivation_path)} if table is not None else {}),
    }
    return write_parquet(out, out_path, metadata=meta)


def summarize(paths: Mapping[str, str | os.PathLike], baseline: str = "fetch_every_miss"):
    """Per-policy summary of emulate outputs `{name: path}` over the same streams: perplexity,
    Δppl % vs `baseline` (moesub.metrics.dppl_pct, the project's one Δppl), substitution
    rate (SUB slots / all slots), mean substituted mass per token-layer, and `prefetches`
    (experts inserted by prefetch over all token-layers, as the simulator's total row; None for
    an output written before emulate counted them)."""
    rows, nll_mean = [], {}
    for name, path in paths.items():
        df = pl.read_parquet(require_file(path, f"paths[{name!r}]"))
        slots = df.select(pl.sum_horizontal(STATUS_NAMES).sum()).item()
        nll_mean[name] = df["nll"].drop_nulls().mean()
        rows.append(
            {
                "policy": name,
                "tokens": df.height,
                "ppl": math.exp(nll_mean[name]),
                "sub_rate": df["sub"].sum() / slots if slots else float("nan"),
                "hit_rate": df["hit"].sum() / slots if slots else float("nan"),
                # `mass` is the sum over the layers: per token-layer, the study's unit
                "mass_mean": (df["mass"] / df["layer_mass"].list.len()).mean(),
                "prefetches": int(df["prefetches"].sum()) if "prefetches" in df.columns else None,
            }
        )
    out = pl.DataFrame(rows)
    if baseline in paths:
        dppl = [float(dppl_pct(nll_mean[n] - nll_mean[baseline])) for n in out["policy"]]
        out = out.with_columns(dppl_pct=pl.Series(dppl, dtype=pl.Float64))
    return out
