"""Replaying a captured model under a policy: what emulate, Experiment B and generation share.

- **model loading** (`load_for_capture`): the model in the capture's dtype, checked against the
  capture's token table (geometry, vocabulary); `check_geometry`, `check_run`
  (a run's name and cache fraction; the replays' options are checked by the config schema);
- **policy routers**: `PolicyRouter` hands each MoE layer's router logits (and, for prefetch,
  the lookahead logits the hook computes from the replayed hidden states) to that layer's
  `moesub.policy.LayerCache` (`make_caches`: fresh caches from the initial resident set, the
  co-activation table for substitute_by='coactivation'; `policy_router` builds both) and
  returns the ids the core computes (`computed_ids`), with the core's selection and the
  model's gate weights for it where route_bias rerouted a row; `BatchRouter` splits a batched
  forward among per-stream routers;
- **greedy decoding** (`greedy_decode`) with the KV cache under a policy (or the exact model),
  and the cached one-step forward the token-by-token oracle shares (`forward_step`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from moesub.artefacts import check_token_table
from moesub.io import read_metadata
from moesub.models import (
    RouterHook,
    align_ids,
    cached_forward,
    load_model,
    moe_info,
    router_weights,
)
from moesub.params import check_dtype, torch_dtype
from moesub.policy import OFFLINE_EVICTIONS, STATUS_NAMES, LayerCache, Policy, check_layers
from moesub.slots import CacheSize


# --------------------------------------------------------------------------- inputs
def check_run(name: Any, size: Any) -> None:
    """A policy run's name (non-empty: it names the artefact) and cache size: a fraction in
    (0, 1] or a resolved size (`moesub.layout.CacheSize.to_dict`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty policy name, got {name!r}")
    CacheSize.of(size, 1)  # the form only: the model's E resolves it later


def policy_from_dict(policy: Mapping[str, Any] | Any) -> Policy:
    """`moesub.policy.Policy` from a config dict, with errors that name the `policy` argument."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, Mapping):
        raise ValueError(f"policy must be a dict (rule, tau, eviction, ...), got {policy!r}")
    try:
        return Policy.from_dict(dict(policy))
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"policy {dict(policy)!r} is invalid: {exc}") from exc


def replay_policy(policy: Mapping[str, Any] | Any) -> Policy:
    """`policy_from_dict`, for a replay: the caches step online with the model, so an offline
    eviction (belady, which needs every future selection) is an error here."""
    pol = policy_from_dict(policy)
    if pol.eviction in OFFLINE_EVICTIONS:
        raise ValueError(
            f"policy eviction {pol.eviction!r} is offline-only (scan and the simulator: it needs "
            "the whole stream's future selections); emulation, Experiment B and generation "
            "replay the model online: use eviction 'lru' or 'lfu'"
        )
    return pol


def check_geometry(meta: Mapping[str, Any], info, arg: str) -> None:
    """A capture artefact's recorded E/k/L (metadata, when present) must match the model's."""
    for key, value in (
        ("num_experts", info.num_experts),
        ("top_k", info.top_k),
        ("num_layers", info.num_layers),
    ):
        if key in meta and int(meta[key]) != value:
            raise ValueError(
                f"{arg}: captured with {key}={meta[key]} but the model has {key}={value}: "
                "the capture was made with another model"
            )


def load_for_capture(
    model_dir: str | os.PathLike,
    tokens_path: Path,
    dtype: str | None,
    device: str,
    loading: Mapping[str, Any] | None = None,
) -> tuple[Any, Any, pl.DataFrame, str]:
    """The model in the capture's dtype (unless `dtype` overrides it), checked against the
    capture token table (E/k/L recorded there, token ids within the vocabulary); `loading`
    (`moesub.models.ModelLoading`) places a model that does not fit one device.

    Returns (model, MoEInfo, token table, dtype)."""
    token_meta = read_metadata(tokens_path)
    dtype = check_dtype(dtype or token_meta.get("dtype", "float32"), "tokens_path: capture dtype")
    model, _tokenizer = load_model(
        model_dir, dtype=torch_dtype(dtype), device=device, loading=loading
    )
    info = moe_info(model)
    check_geometry(token_meta, info, "tokens_path")
    tokens = check_token_table(pl.read_parquet(tokens_path), info.vocab_size)
    return model, info, tokens, dtype


# --------------------------------------------------------------------------- policy routers
@dataclass
class StreamTrace:
    """What the core decided for one stream, layer by layer (T tokens, L layers, top-k)."""

    nll: np.ndarray  # float64 (T,), NaN at pos 0
    mass: np.ndarray  # float64 (T, L) substituted gate mass
    counts: np.ndarray  # int64 (T, 5) slots per status code, summed over layers
    prefetched: np.ndarray  # int32 (T, L) experts inserted by prefetch (step 1b)
    status: np.ndarray | None = None  # int8 (T, L, k), when recorded
    ids: np.ndarray | None = None  # int32 (T, L, k) computed expert, when recorded
    selected: np.ndarray | None = None  # int32 (T, L, k) the core's selection S, when recorded
    logits: np.ndarray | None = None  # float32 (T, L, E) replayed router logits, when recorded
    lookahead: np.ndarray | None = None  # float32 (T, L, E) replayed lookahead (prefetch only)
    admissions: int = 0  # admission requests made by the core, summed over layers


@dataclass
class PolicyRouter:
    """RouterHook callback: layer l's rows go through `caches[l]`; the core's ids are computed.

    Rows arrive in stream order (the whole stream at once, or one decode step at a time); each
    call advances that layer's cache clock by the number of rows. With prefetch the hook must
    pass the lookahead logits (`needs_lookahead`; `router_context` asks for them): recomputed
    from the replayed hidden states, since substitution changes them. With route_bias the core
    may select other experts than the router: those rows compute the core's selection with the
    model's gate weights for it (`moesub.models.router_weights`; `norm_topk_prob` says whether
    the model renormalizes them). `record` keeps ids, status and the core's inputs for the
    tests; otherwise only mass, per-status counts and prefetch insertions are kept.
    """

    caches: list
    record: bool = False
    norm_topk_prob: bool | None = None  # the model's gate (moe_info); needed for route_bias
    _parts: list[list[tuple]] = field(default_factory=list)
    _admissions: int = 0

    def __post_init__(self) -> None:
        self._parts = [[] for _ in self.caches]
        self.policy = self.caches[0].policy
        if self.policy.route_bias > 0 and self.norm_topk_prob is None:
            raise ValueError(
                "PolicyRouter: route_bias > 0 needs norm_topk_prob (the model's gate, "
                "moe_info(model).norm_topk_prob) to weight rerouted rows; use policy_router"
            )

    @property
    def needs_lookahead(self) -> bool:
        return self.policy.prefetch > 0

    def __call__(
        self,
        layer: int,
        logits: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        lookahead: torch.Tensor | None = None,
    ):
        z = np.ascontiguousarray(logits.detach().to(torch.float32).cpu().numpy())  # (N, E)
        y = None
        if self.needs_lookahead:
            if lookahead is None:
                raise RuntimeError("PolicyRouter: prefetch needs the hook's lookahead logits")
            y = np.ascontiguousarray(lookahead.detach().to(torch.float32).cpu().numpy())
        s = self.caches[layer].step(z, y)
        status = np.asarray(s.status)
        counts = np.stack([(status == c).sum(axis=1) for c in range(len(STATUS_NAMES))], axis=1)
        part = (np.asarray(s.mass, dtype=np.float64), counts, s.prefetched.copy())
        if self.record:
            part += (status.copy(), s.ids.copy(), s.selected.copy(), z)
            part += (y if y is not None else np.zeros((len(z), 0), np.float32),)
        self._parts[layer].append(part)
        self._admissions += len(s.admissions)
        if self.policy.route_bias > 0:
            return rerouted_ids(ids, weights, s.selected, s.ids, logits, bool(self.norm_topk_prob))
        return computed_ids(ids, s.selected, s.ids, logits)

    def last_mass(self) -> float:
        """Substituted mass of the most recent row, summed over layers."""
        return float(sum(parts[-1][0][-1] for parts in self._parts if parts))

    def take(self, nll: np.ndarray) -> StreamTrace:
        """Everything recorded since the last `take`, as a StreamTrace; resets the buffers."""
        if any(not parts for parts in self._parts):
            raise RuntimeError("router hook did not see every MoE layer")
        per_layer = [
            tuple(np.concatenate(column) for column in zip(*parts, strict=True))
            for parts in self._parts
        ]
        self._parts = [[] for _ in self.caches]
        admissions, self._admissions = self._admissions, 0
        lengths = {p[0].shape[0] for p in per_layer}
        if lengths != {len(nll)}:
            raise RuntimeError(
                f"router hook saw {sorted(lengths)} rows per layer for a {len(nll)}-token stream"
            )
        trace = StreamTrace(
            nll=np.asarray(nll, dtype=np.float64),
            mass=np.stack([p[0] for p in per_layer], axis=1),
            counts=np.sum([p[1] for p in per_layer], axis=0).astype(np.int64),
            prefetched=np.stack([p[2] for p in per_layer], axis=1),
            admissions=admissions,
        )
        if self.record:
            trace.status = np.stack([p[3] for p in per_layer], axis=1)
            trace.ids = np.stack([p[4] for p in per_layer], axis=1)
            trace.selected = np.stack([p[5] for p in per_layer], axis=1)
            trace.logits = np.stack([p[6] for p in per_layer], axis=1)
            if self.needs_lookahead:
                trace.lookahead = np.stack([p[7] for p in per_layer], axis=1)
        return trace


def computed_ids(
    model_ids: torch.Tensor, selected: np.ndarray, computed: np.ndarray, logits: torch.Tensor
) -> torch.Tensor | None:
    """Replacement ids for the router hook: None when the model's own choice stands (every
    rank computes its selected expert), the core's ids directly when the model's slot order is
    the core's rank order (the usual case), `align_ids` otherwise (ties, other slot orders)."""
    if model_ids.device.type == "cpu" and np.array_equal(model_ids.numpy(), selected):
        if np.array_equal(computed, selected):
            return None
        return torch.from_numpy(np.ascontiguousarray(computed)).to(model_ids.dtype)
    return align_ids(model_ids, selected, computed, logits=logits)


def rerouted_rows(model_ids: torch.Tensor, selected: np.ndarray) -> np.ndarray:
    """(N,) bool: the rows whose core selection S (route_bias) is not the router's own top-k set
    (a tie at the k-th place is not a reroute: `align_ids` resolves it)."""
    mid = model_ids.detach().cpu().numpy()
    return ~(np.sort(mid, axis=1) == np.sort(selected, axis=1)).all(axis=1)


def place_ranked(
    model_ids: torch.Tensor,
    selected: np.ndarray,
    per_rank: np.ndarray,
    logits: torch.Tensor,
    rerouted: np.ndarray,
) -> torch.Tensor:
    """A per-rank array `(N, k)` of the core (computed experts; the engine's cache slots) in the
    slot order the block computes in: the model's slot order (`align_ids`) for a row the router
    chose itself, S's rank order for a rerouted row. On `model_ids`' device and dtype."""
    if not rerouted.any():
        return align_ids(model_ids, selected, per_rank, logits=logits)
    out = torch.from_numpy(np.ascontiguousarray(per_rank)).to(model_ids)
    keep = ~rerouted
    if keep.any():
        k = torch.from_numpy(keep)
        out[k.to(out.device)] = align_ids(
            model_ids[k.to(model_ids.device)], selected[keep], per_rank[keep],
            logits=logits[k.to(logits.device)],  # a placed model's router may run elsewhere
        ).to(out)  # fmt: skip
    return out


def rerouted_weights(
    weights: torch.Tensor,
    logits: torch.Tensor,
    selected: np.ndarray,
    rerouted: np.ndarray,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """The slot weights for `place_ranked`'s order: the model's own where the router chose the
    row (bit for bit), the weights the model's router gives S (`router_weights`, in S's rank
    order) where the core rerouted it. On `weights`' device and dtype."""
    out = weights.clone()
    sel = torch.from_numpy(np.ascontiguousarray(selected[rerouted]))
    r = torch.from_numpy(rerouted)
    out[r.to(out.device)] = router_weights(logits[r.to(logits.device)], sel, norm_topk_prob).to(out)
    return out


def rerouted_ids(
    model_ids: torch.Tensor,
    weights: torch.Tensor,
    selected: np.ndarray,
    computed: np.ndarray,
    logits: torch.Tensor,
    norm_topk_prob: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Replacement for the router hook under route_bias: `computed_ids`' answer when no row was
    rerouted (the model's weights stand, bit for bit), else `(weights, ids)`: the core's
    computed experts by `place_ranked` with `rerouted_weights`. The engine's router hook
    (`moesub.engine.adapter`) places its slots with the same two functions."""
    rerouted = rerouted_rows(model_ids, selected)
    if not rerouted.any():
        return computed_ids(model_ids, selected, computed, logits)
    ids = place_ranked(model_ids, selected, computed, logits, rerouted)
    return rerouted_weights(weights, logits, selected, rerouted, norm_topk_prob), ids


@dataclass
class BatchRouter:
    """RouterHook callback for a forward over B equal-length streams: the hook's N = B*T rows
    are batch-major, so stream b's rows `[b*T, (b+1)*T)` (and lookahead rows, when the hook
    passes them) go through `routers[b]` (its own per-layer caches); the replacement ids (and
    weights, where a router replaced them) are concatenated back in the same order."""

    routers: list

    @property
    def needs_lookahead(self) -> bool:
        return any(getattr(r, "needs_lookahead", False) for r in self.routers)

    def __call__(
        self,
        layer: int,
        logits: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        lookahead: torch.Tensor | None = None,
    ):
        T = logits.shape[0] // len(self.routers)
        rows = [slice(b * T, (b + 1) * T) for b in range(len(self.routers))]
        new = [
            r(layer, logits[s], weights[s], ids[s])
            if lookahead is None
            else r(layer, logits[s], weights[s], ids[s], lookahead[s])
            for r, s in zip(self.routers, rows, strict=True)
        ]
        if all(n is None for n in new):
            return None
        out_ids, out_w = [], []
        for n, s in zip(new, rows, strict=True):
            w, i = n if isinstance(n, tuple) else (weights[s], ids[s] if n is None else n)
            out_ids.append(i.to(ids.device))
            out_w.append(w.to(weights.device))
        if not any(isinstance(n, tuple) for n in new):
            return torch.cat(out_ids)
        return torch.cat(out_w), torch.cat(out_ids)


def make_caches(
    model,
    policy,
    capacity: int | Sequence[int],
    initial: Any,
    coactivation: np.ndarray | None = None,
) -> list:
    """One fresh `LayerCache` per MoE layer: layer l's capacity, initial set and policy (its
    pins: `Policy.for_layer`), from the forms `scan` takes (`moesub.policy.check_layers`: an int
    or L capacities; None, an (L, C) array or L initial sets); `coactivation` (L, E, E): the
    table substitute_by='coactivation' ranks candidates by
    (`moesub.coactivation.read_coactivation`), required by such a policy."""
    info = moe_info(model)
    policy = replay_policy(policy)
    L, E = info.num_layers, info.num_experts
    layers = check_layers(policy, info.top_k, capacity, initial, L, E)
    if policy.substitute_by == "coactivation":
        if coactivation is None:
            raise ValueError(
                "coactivation: policy substitute_by='coactivation' needs the model's "
                "co-activation table (results/{model}/coactivation.npz, moesub.coactivation)"
            )
        coactivation = np.asarray(coactivation)
        if coactivation.shape != (L, E, E):
            raise ValueError(
                f"coactivation: expected the model's (L, E, E) = {(L, E, E)} table, got shape "
                f"{coactivation.shape}"
            )
    else:
        coactivation = None  # unused: the core rejects a table for another ranking
    return [
        LayerCache(
            num_experts=E,
            k=info.top_k,
            capacity=layers.capacities[layer],
            policy=policy.for_layer(layer),
            initial=layers.initials[layer],
            coactivation=None if coactivation is None else coactivation[layer],
        )
        for layer in range(L)
    ]


def policy_router(
    model,
    policy,
    capacity: int | Sequence[int],
    initial: Any,
    coactivation: np.ndarray | None = None,
    record: bool = False,
) -> PolicyRouter:
    """A `PolicyRouter` over fresh caches (`make_caches`) for `model`'s gate."""
    caches = make_caches(model, policy, capacity, initial, coactivation)
    return PolicyRouter(caches, record=record, norm_topk_prob=moe_info(model).norm_topk_prob)


# --------------------------------------------------------------------------- decoding steps
def forward_step(model, input_ids: torch.Tensor, cache):
    """One cached forward over input_ids [1, n]: (next-token logits of the last row [V] float64,
    the updated KV cache)."""
    out, cache = cached_forward(model, input_ids, cache)
    return out.logits[0, -1].to(torch.float64), cache


def router_context(model, router):
    """`RouterHook(model, router)` (computing the lookahead logits when the router needs
    them), or nothing for the exact model (router None)."""
    if router is None:
        return contextlib.nullcontext()
    return RouterHook(model, router, lookahead=getattr(router, "needs_lookahead", False))
