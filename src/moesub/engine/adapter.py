"""The model adapter: a Hugging Face MoE model whose routed experts live in an engine tier.

`build_engine_model` loads the model, moves its experts to the slow tier (the expert store on
disk for the CPU engine, pinned host memory for the CUDA engine), allocates the slots and swaps
every block's experts module for `EngineExperts`. Per token and MoE layer the router hook
(`EngineRouter`, installed with `moesub.models.RouterHook`) hands the router logits to the
engine (`OffloadEngine.route`: the policy core decides, the tier copies) and returns the *cache
slot* of every computed expert in the model's slot order (`models.align_ids`); the block's
`EngineExperts` then computes from the slot tensors, plus host_compute misses on the host.
The model's own expert weights are dropped: experts live only in the slow tier and the slots.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moesub.engine.cuda_tier import CudaTier
from moesub.engine.runtime import OffloadEngine
from moesub.engine.spec import EngineParams
from moesub.engine.store import (
    DTYPES,
    StoreLayout,
    dtype_name,
    measure_read_bandwidth,
    model_experts,
    open_or_write_store,
    tensor_fingerprint,
)
from moesub.engine.tiers import DiskTier, require_cuda
from moesub.policy import HOST


class EngineExperts(nn.Module):
    """Replaces a block's experts: computes from the engine's slots (ids = slot indices).

    Without an engine attached (dense-time calibration) it returns zeros. `gate_up_proj` /
    `down_proj` are the layer's slot tensors (plain attributes, not parameters: `model.to` leaves
    them where the tier put them), so the block still reads as a sparse MoE block.
    """

    def __init__(self, layer: int, slots) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = slots.gate_up  # (C, 2I, H)
        self.down_proj = slots.down  # (C, H, I)
        self.engine: OffloadEngine | None = None
        self.host_ids: np.ndarray | None = None  # (N, k) model slot order, set by the router

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.engine is None:
            return torch.zeros_like(hidden)
        return self.engine.compute(self.layer, hidden, top_k_index, top_k_weights, self.host_ids)


class EngineRouter:
    """RouterHook callback: the core decides, the engine copies, the experts see slot ids."""

    def __init__(self, engine: OffloadEngine, experts: list[EngineExperts]) -> None:
        self.engine, self.experts = engine, experts

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        from moesub.models import align_ids

        z = np.ascontiguousarray(logits.detach().float().cpu().numpy())  # (1, E)
        s = self.engine.route(layer, z)
        host = None
        if (s.status == HOST).any():
            computed = np.where(s.status == HOST, s.selected, -1)
            host = align_ids(ids.cpu(), s.selected, computed, logits=logits.cpu()).numpy()
        self.experts[layer].host_ids = host
        return align_ids(ids, s.selected, s.slot, logits=logits)  # slot per model slot, -1 HOST


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


def build_engine_model(
    model_dir: str | os.PathLike,
    device: str,
    opts: EngineParams,
    capacity: int | None,
    measure_bandwidth: bool = False,
) -> EngineSetup:
    """Load the model, move its experts to the slow tier (disk file written once, or pinned host
    memory), allocate `capacity` slots per layer (default k) and swap in `EngineExperts`."""
    from moesub.models import expert_weights, load_model, moe_blocks, moe_info

    dev = require_cuda(device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dtype = DTYPES[opts.dtype]
    model, _tok = load_model(model_dir, dtype=dtype, device="cpu")
    info = moe_info(model)
    C = info.top_k if capacity is None else capacity
    if not info.top_k <= C <= info.num_experts:
        raise ValueError(
            f"cache capacity {C} is too small for k={info.top_k} (or exceeds E={info.num_experts})"
        )
    blocks = moe_blocks(model)
    weights = [expert_weights(b) for b in blocks]  # (E, 2I, H), (E, H, I) per layer
    act = blocks[0].experts.act_fn
    bandwidth = None
    if dev.type == "cpu":
        layout = StoreLayout(
            num_layers=info.num_layers,
            num_experts=info.num_experts,
            hidden=info.hidden_size,
            width=info.expert_width,
            dtype=dtype_name(dtype),
            fingerprint=tensor_fingerprint(
                t for gu, dn in weights for t in (gu[:, 0, :], dn[:, 0, :])
            ),
        )
        path = (
            Path(opts.store_path) if opts.store_path else default_store_path(model_dir, opts.dtype)
        )
        store = open_or_write_store(path, layout, model_experts(weights), progress=opts.progress)
        tier: DiskTier | CudaTier = DiskTier(store, C, info.top_k, act, opts.staging_buffers)
        if measure_bandwidth:
            bw = measure_read_bandwidth(store, reads=min(32, info.num_layers * info.num_experts))
            bandwidth = {"read_bandwidth_Bps": bw.bytes_per_s, "read_latency_s": bw.latency_s}
        expert_bytes = layout.expert_bytes
    else:
        host = [(gu.detach().contiguous(), dn.detach().contiguous()) for gu, dn in weights]
        tier = CudaTier(host, C, dev, act, opts.staging_buffers)
        expert_bytes = tier.expert_bytes
        del host
    experts = []
    for layer, block in enumerate(blocks):
        block.experts = EngineExperts(layer, tier.slots[layer])
        experts.append(block.experts)
    del weights
    gc.collect()
    model.to(dev)
    return EngineSetup(model, info, tier, experts, act, expert_bytes, dev, bandwidth)
