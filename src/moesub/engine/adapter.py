"""The model adapter: a Hugging Face MoE model whose routed experts live in an engine tier.

`load_engine_model` loads the model and moves its experts to the slow tier (the expert store on
disk; for the CUDA engine pinned host memory filled from it, once); `build_engine_model` gives
it a fresh tier with its slots and swaps every block's experts module for `EngineExperts` (many
engines, one after another, on one loaded model). What it knows of the model's layout comes from
the family's adapter (`moesub.models.moe_family`): the router module, the experts in the
engine's expert layout and their activation, how the block's experts are swapped.

Per token and MoE layer the router hook (`EngineRouter`, installed with
`moesub.models.RouterHook`) brings the router's values to the host once, hands the logits to the
engine (`OffloadEngine.route`: the policy core decides, the tier copies) and gives the block's
`EngineExperts` the *cache slot* of every computed expert in the model's slot order
(`models.align_ids`, on the host); `EngineExperts` then computes from the slot tensors, plus the
host's experts on the host.
With `policy.prefetch > 0` the hook is a `PrefetchHook`: layer l's lookahead logits are computed
as soon as their source is seen (the residual stream entering MoE layer l-1's MoE sub-block) and
handed to `OffloadEngine.prefetch` at once, so the copies run while layer l-1's experts and layer
l's attention compute.
The model's own expert weights are dropped: experts live only in the slow tier and the slots.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moesub.engine.cuda_tier import CudaTier
from moesub.engine.host_memory import HostExperts
from moesub.engine.runtime import HostInputs, OffloadEngine
from moesub.engine.spec import EngineParams, engine_dtype
from moesub.engine.store import (
    DTYPES,
    ExpertStore,
    StoreLayout,
    measure_read_bandwidth,
    model_experts,
    open_or_write_store,
    tensor_fingerprint,
)
from moesub.engine.tiers import (
    DISK_STAGING_BUFFERS,
    DiskTier,
    expert_runs,
    layer_capacities,
    require_cuda,
)
from moesub.models import RouterHook, moe_family
from moesub.policy import HOST, check_capacity
from moesub.replay import place_ranked, rerouted_rows, rerouted_weights


def prefill_forward(
    engine: OffloadEngine, layer: int, hidden: torch.Tensor, ids: np.ndarray, weights: torch.Tensor
) -> torch.Tensor:
    """A prompt's routed expert output [N, H]: `ids (N, k)` the computed experts (-1 = none),
    read from the slow tier in runs of nearby ids (`tiers.expert_runs`, `read_range`), each
    applied to all its rows in one matmul on the host, as transformers' experts loop does; the
    weighted outputs are summed over the k slots in slot order, as `kernels.expert_forward`."""
    x, w = hidden.detach().cpu(), weights.detach().cpu()
    ids = np.asarray(ids)
    ys = x.new_zeros(*ids.shape, x.shape[-1])  # (N, k, H)
    for lo, run in expert_runs(np.unique(ids[ids >= 0]), engine.tier.layout.expert_stride):
        gu, dn = engine.tier.read_range(layer, lo, run[-1] - lo + 1)
        for e in run:
            rows, slots = np.nonzero(ids == e)
            gate, up = F.linear(x[rows].to(gu.dtype), gu[e - lo]).chunk(2, dim=-1)
            y = F.linear(engine.act(gate) * up, dn[e - lo])  # (rows, H)
            ys[rows, slots] = (y * w[rows, slots].to(y.dtype)[:, None]).to(ys.dtype)
    return ys.sum(dim=1).to(device=hidden.device, dtype=hidden.dtype)


class EngineExperts(nn.Module):
    """Replaces a block's experts: computes from the engine's slots, as the router planned.

    The router hook (`EngineRouter`) leaves the model's expert ids in place and hands this module
    the token's plan on the host: the cache slot of every computed expert in the model's slot
    order (`slot_ids`, -1 = not on the fast tier) and the host_compute misses (`host`); for a
    prompt's rows (prefill) the computed experts themselves (`prefill_ids`). Without
    an engine attached (dense-time calibration) it returns zeros. It holds no weights: the
    engine computes from the tier's slots.
    """

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.engine: OffloadEngine | None = None
        self.slot_ids: np.ndarray | None = None  # (N, k) set by the router for one call
        self.host: HostInputs | None = None
        self.prefill_ids: np.ndarray | None = None  # (N, k) experts, a prompt's rows

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.engine is None:
            return torch.zeros_like(hidden)
        if self.prefill_ids is not None:
            ids, self.prefill_ids = self.prefill_ids, None
            return prefill_forward(self.engine, self.layer, hidden, ids, top_k_weights)
        if self.slot_ids is None:
            raise RuntimeError(
                f"EngineExperts (layer {self.layer}): no routing plan; the engine's router hook "
                "is not installed"
            )
        slot_ids, host, self.slot_ids, self.host = self.slot_ids, self.host, None, None
        return self.engine.compute(self.layer, hidden, slot_ids, top_k_weights, host)


class EngineRouter:
    """RouterHook callback: one transfer of the router's values to the host per layer (logits,
    the model's ids and weights, and the router's input, kept by a pre-hook on every router for
    host_compute), the policy core's decision, the tier's copies, and the plan handed to the
    block's `EngineExperts`. Returns None: the model's ids and weights stay (the experts do not
    read the ids). Cache-aware routing (route_bias) is the emulator's (`moesub.replay`): a row
    the core rerouted computes S's experts in S's rank order with the weights the model's router
    gives S (`place_ranked`, `rerouted_weights`), and the hook then returns those weights (with
    the computed experts) so that the block hands them to `EngineExperts`.
    `close()` removes the pre-hooks."""

    def __init__(self, engine: OffloadEngine, setup: EngineSetup):
        from moesub.models import moe_blocks

        self.engine, self.experts = engine, setup.experts
        self.norm_topk_prob = setup.info.norm_topk_prob  # the gate of rerouted rows
        self._hidden: list[torch.Tensor | None] = [None] * len(setup.experts)
        family = moe_family(setup.model)
        self._handles = [
            family.router(block).register_forward_pre_hook(
                self._keep_input(layer), with_kwargs=True
            )
            for layer, block in enumerate(moe_blocks(setup.model))
        ]

    def _keep_input(self, layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._hidden[layer] = args[0] if args else next(iter(kwargs.values()))

        return hook

    def __call__(
        self,
        layer: int,
        logits: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        lookahead: torch.Tensor | None = None,  # PrefetchHook: already with the engine
    ):
        hidden, self._hidden[layer] = self._hidden[layer], None
        hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        z, model_ids, w, h = self.engine.to_host(layer, logits, ids, weights, hidden)
        z = np.ascontiguousarray(z.numpy(), dtype=np.float32)  # (1, E); (N, E) in a prefill
        zt = torch.from_numpy(z)
        plan = self.experts[layer]
        prefill = self.engine.prefilling
        if prefill:  # a prompt's rows: computed from the slow tier
            y = None if lookahead is None else lookahead.float().cpu().numpy()
            s = self.engine.route_prefill(layer, z, y)
        else:
            s = self.engine.route(layer, z)
        # route_bias: a row the core rerouted takes S's rank order and S's weights (as emulated)
        rerouted = np.zeros(len(z), bool)
        if self.engine.policy.route_bias > 0:
            rerouted = rerouted_rows(model_ids, s.selected)
            if rerouted.any():
                w = rerouted_weights(w, zt, s.selected, rerouted, self.norm_topk_prob)

        def place(per_rank: np.ndarray) -> np.ndarray:  # in the block's slot order
            return place_ranked(model_ids, s.selected, per_rank, zt, rerouted).numpy()

        if prefill:
            plan.prefill_ids = place(s.ids)
        else:
            plan.slot_ids = place(s.slot)
            plan.host = None
            if (s.status == HOST).any():
                plan.host = HostInputs(place(np.where(s.status == HOST, s.selected, -1)), h, w)
        if rerouted.any():  # the block hands S's weights to EngineExperts (it reads no ids)
            return w, torch.from_numpy(place(s.ids))
        return None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class PrefetchHook(RouterHook):
    """`RouterHook(lookahead=True)` whose lookahead is computed early: when the tap records MoE
    layer l's source stream (entering layer l-1's MoE sub-block; for layer 0 its decoder layer),
    layer l's lookahead logits are computed at once (the hook's own norm and router call, so
    exactly the captured lookahead) and handed to `engine.prefetch(l, y)` (one counted device ->
    host transfer). The router hook later passes the same logits to `on_route`."""

    def __init__(self, model: nn.Module, on_route, engine: OffloadEngine, device: torch.device):
        super().__init__(model, on_route, lookahead=True)
        self.engine, self.device = engine, device
        self._early: dict[int, torch.Tensor] = {}

    def _make_tap(self, index: int, kwarg: str | None):
        record = super()._make_tap(index, kwarg)

        def tap(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._inner:
                return None
            record(module, args, kwargs)
            y = RouterHook._lookahead_logits(self, index, self.device)  # frees the source
            self._early[index] = y
            if self.engine.prefilling:  # a prompt's rows: the router hook passes them on
                return None
            (y_host,) = self.engine.to_host(index, y)
            self.engine.prefetch(index, y_host.numpy())
            return None

        return tap

    def _lookahead_logits(self, layer: int, device: torch.device) -> torch.Tensor:
        y = self._early.pop(layer, None)
        if y is None:
            raise RuntimeError(f"lookahead of MoE layer {layer}: its residual stream was not seen")
        return y.to(device)


def staging_for(opts: EngineParams, device: torch.device, prefetch: int) -> int | None:
    """Staging buffers of the tier: the option, else the tier's default (None), raised on the
    disk tier to hold two layers' prefetches beside its admissions. A given number too small
    for the prefetches in flight (those of layer l and l+1 can wait together) is an error."""
    need = 2 * prefetch + 1
    if opts.staging_buffers is not None:
        if prefetch and opts.staging_buffers < need:
            raise ValueError(
                f"engine.staging_buffers={opts.staging_buffers} is too few for policy prefetch "
                f"{prefetch}: copies of two layers can be in flight at once, give >= {need}"
            )
        return opts.staging_buffers
    if device.type == "cpu" and prefetch:
        return DISK_STAGING_BUFFERS + 2 * prefetch
    return None


@dataclass
class EngineSetup:
    """A loaded model whose experts live in a tier (see `build_engine_model`)."""

    model: nn.Module
    info: Any  # moesub.models.MoEInfo
    tier: DiskTier | CudaTier
    experts: list[EngineExperts]
    act: Any
    expert_bytes: int
    device: torch.device
    bandwidth: dict[str, Any] | None  # disk tier: measured read bandwidth


def default_store_path(model_dir: str | os.PathLike, dtype: str) -> Path:
    """`<model_dir>/../engine/experts-<dtype>.bin` (results/{model}/engine/ in the pipeline)."""
    return Path(model_dir).resolve().parent / "engine" / f"experts-{dtype}.bin"


@dataclass
class LoadedModel:
    """A model loaded once, its experts in the expert store and no longer in the model (see
    `load_engine_model`): what every engine built on it shares (`build_engine_model`),
    so that a job running many engines on one model (the pipeline's engine stage) reads the
    checkpoint, writes or checks the store and fills the pinned host memory once."""

    model: nn.Module  # on the engine's device, each block's experts module swapped per engine
    info: Any  # moesub.models.MoEInfo
    family: Any  # moesub.models.moe_family(model)
    blocks: list[nn.Module]  # the MoE blocks (found by their experts, which are gone)
    act: Any
    store: ExpertStore
    host: HostExperts | None  # the CUDA tier's experts in pinned host memory
    expert_bytes: int
    device: torch.device
    dtype: str
    pinned_budget_gb: float | None
    bandwidth: dict[str, Any] | None  # measured read bandwidth of the store

    def tier(self, caps: list[int], staging: int | None) -> DiskTier | CudaTier:
        """A fresh tier of `caps` slots per layer on the shared store (or pinned experts)."""
        if self.device.type == "cpu":
            return DiskTier(self.store, caps, self.info.top_k, self.act, staging)
        if self.host is None:
            budget = None if self.pinned_budget_gb is None else int(self.pinned_budget_gb * 2**30)
            self.host = HostExperts(self.store, budget)
        return CudaTier(self.host, caps, self.device, self.act, staging, top_k=self.info.top_k)

    def close(self) -> None:
        self.store.close()

    def check(self, device: torch.device, opts: EngineParams) -> None:
        """An engine's options must be those the model was loaded with."""
        want = (device, engine_dtype(opts, device), opts.pinned_budget_gb)
        have = (self.device, self.dtype, self.pinned_budget_gb)
        if want != have:
            raise ValueError(
                f"engine: the loaded model has (device, dtype, pinned_budget_gb) {have}, the "
                f"engine asks for {want}"
            )


def check_capacities(capacity: int | Sequence[int] | None, info: Any) -> list[int]:
    """Slots per layer (an int, or one per layer; default k), each within [k, E]."""
    E, k = info.num_experts, info.top_k
    caps = layer_capacities(k if capacity is None else capacity, info.num_layers)
    for layer, C in enumerate(caps):
        try:  # C as a fraction of E: capacity_for(C / E, E) is C
            check_capacity(C / E, E, k)
        except ValueError as e:
            where = "" if isinstance(capacity, int) else f" of layer {layer}"
            raise ValueError(f"cache capacity {C}{where} (E={E}, k={k}): {e}") from e
    return caps


def load_engine_model(
    model_dir: str | os.PathLike,
    device: str,
    opts: EngineParams,
    capacity: int | Sequence[int] | None = None,
    measure_bandwidth: bool = False,
) -> LoadedModel:
    """Load the model, write its experts to the expert store (once: later runs reuse the file),
    drop them from the model and move the rest to the device. `capacity` (slots per layer, if
    given) is checked against the model before the store is written.

    Host memory: loading the checkpoint holds its experts once (transformers' loader); they are
    released before any tier allocates, so the host never holds two copies of them."""
    from moesub.models import load_model, moe_blocks, moe_info

    dev = require_cuda(device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dtype_key = engine_dtype(opts, dev)
    model, _tok = load_model(model_dir, dtype=DTYPES[dtype_key], device="cpu")
    info, family = moe_info(model), moe_family(model)
    if capacity is not None:
        check_capacities(capacity, info)
    blocks = moe_blocks(model)
    act = family.expert_act(blocks[0])
    weights = [family.expert_weights(b) for b in blocks]  # (E, 2I, H), (E, H, I) per layer
    layout = StoreLayout(
        num_layers=info.num_layers,
        num_experts=info.num_experts,
        hidden=info.hidden_size,
        width=info.expert_width,
        dtype=dtype_key,
        fingerprint=tensor_fingerprint(t for gu, dn in weights for t in (gu[:, 0, :], dn[:, 0, :])),
    )
    path = Path(opts.store_path) if opts.store_path else default_store_path(model_dir, dtype_key)
    store = open_or_write_store(path, layout, model_experts(weights), progress=opts.progress)
    for block in blocks:  # the model's own experts go before the tier allocates anything
        family.set_experts(block, None)
    del weights
    gc.collect()
    bandwidth = None
    if measure_bandwidth:
        bw = measure_read_bandwidth(store, reads=min(32, info.num_layers * info.num_experts))
        bandwidth = {"read_bandwidth_Bps": bw.bytes_per_s, "read_latency_s": bw.latency_s}
    model.to(dev)
    return LoadedModel(
        model, info, family, blocks, act, store, None, layout.expert_bytes, dev, dtype_key,
        opts.pinned_budget_gb, bandwidth,
    )  # fmt: skip


def build_engine_model(
    loaded: LoadedModel,
    device: str,
    opts: EngineParams,
    capacity: int | Sequence[int] | None,
    prefetch: int = 0,
) -> EngineSetup:
    """The loaded model (`load_engine_model`) with a fresh tier built from its store: the disk
    tier reads the file; the CUDA tier reads from the pinned host memory filled once per loaded
    model (as many layers as `opts.pinned_budget_gb` holds; the others stay on disk). Allocates
    `capacity` slots per layer (an int, or one per layer; default k) and swaps in
    `EngineExperts`. `prefetch`: the policy's, for the number of staging buffers
    (`staging_for`)."""
    dev = require_cuda(device)
    staging = staging_for(opts, dev, prefetch)
    loaded.check(dev, opts)
    caps = check_capacities(capacity, loaded.info)
    tier = loaded.tier(caps, staging)
    experts = []
    for layer, block in enumerate(loaded.blocks):
        experts.append(EngineExperts(layer))
        loaded.family.set_experts(block, experts[-1])
    return EngineSetup(
        loaded.model, loaded.info, tier, experts, loaded.act, loaded.expert_bytes, dev,
        loaded.bandwidth,
    )  # fmt: skip
