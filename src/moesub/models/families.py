"""Which transformers MoE families moesub reads, and where their sparse blocks sit.

Supported families (transformers 5 module layout, measured on 5.24): Qwen3-Next, Qwen3-MoE,
Qwen2-MoE, OLMoE, FlexOlmo and Mixtral. In all of them decoder layer `i` is
`model.model.layers[i]`, its MLP is `layer.mlp` (or `layer.block_sparse_moe`), and an MoE
layer's MLP is a sparse block with

- `block.gate`: a TopKRouter with `weight [E, H]`, `top_k`, `num_experts` whose forward maps
  hidden states `[N, H]` to `(router_logits [N, E], weights [N, k], ids [N, k])`: softmax in
  float32, top-k of the probabilities (descending), renormalized over the k when
  `norm_topk_prob` (always for Mixtral);
- `block.experts`: fused 3-D parameters `gate_up_proj [E, 2I, H]` (gate half first) and
  `down_proj [E, H, I]`;
- Qwen3-Next / Qwen2-MoE only: `block.shared_expert` (a dense MLP) and `block.shared_expert_gate`.

Everything here reads the module structure only, so it works on a meta-device model too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# model_type -> whether the router always renormalizes its top-k weights (no config flag).
_FAMILIES: dict[str, bool] = {
    "qwen3_next": False,
    "qwen3_moe": False,
    "qwen2_moe": False,
    "olmoe": False,
    "flex_olmo": False,
    "mixtral": True,
}
SUPPORTED_FAMILIES = tuple(sorted(_FAMILIES))
# model_type -> the decoder layer's norm between the residual stream and the MoE block (None:
# the block reads the residual stream itself; FlexOlmo normalizes after its MLP instead).
_PRE_MOE_NORM: dict[str, str | None] = {f: "post_attention_layernorm" for f in _FAMILIES}
_PRE_MOE_NORM["flex_olmo"] = None
_BLOCK_ATTRS = ("mlp", "block_sparse_moe")


@dataclass(frozen=True)
class MoEInfo:
    """Routing geometry of an MoE model (the same in every MoE layer)."""

    family: str  # config.model_type
    num_layers: int  # number of MoE layers L
    layer_indices: tuple[int, ...]  # decoder-layer index of each MoE layer, ascending
    num_experts: int  # routed experts per layer E
    top_k: int  # experts selected per token k
    norm_topk_prob: bool  # top-k weights renormalized to sum 1
    hidden_size: int  # H
    expert_width: int  # I (an expert's intermediate size)
    has_shared_expert: bool
    vocab_size: int

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layer_indices"] = list(self.layer_indices)
        return d


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"model {type(model).__name__}: no decoder layer list at `model.model.layers`"
        )
    return layers


def _family(model: nn.Module) -> str:
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in _FAMILIES:
        raise ValueError(
            f"model family {family!r} ({type(model).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def _is_sparse_block(block: nn.Module | None) -> bool:
    experts = getattr(block, "experts", None)
    gate = getattr(block, "gate", None)
    return (
        isinstance(gate, nn.Module)
        and isinstance(getattr(gate, "weight", None), torch.Tensor)
        and hasattr(gate, "top_k")
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


def _moe_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder-layer index, sparse block) for every MoE layer, in layer order."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        for attr in _BLOCK_ATTRS:
            block = getattr(layer, attr, None)
            if _is_sparse_block(block):
                out.append((i, block))
                break
    return out


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of `model`, in layer order (MoE layer l is element l)."""
    _family(model)
    blocks = [b for _, b in _moe_layers(model)]
    if not blocks:
        raise ValueError(f"model {type(model).__name__} has no sparse MoE layer")
    return blocks


def expert_weights(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's fused expert parameters `(gate_up [E, 2I, H], down [E, H, I])` (not copies)."""
    if not _is_sparse_block(block):
        raise ValueError(f"{type(block).__name__} is not a sparse MoE block")
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    E, two_i, H = gate_up.shape
    if down.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(
            f"{type(block).__name__}: unexpected expert layout gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)} (expected [E, 2I, H] and [E, H, I])"
        )
    return gate_up, down


def moe_info(model: nn.Module) -> MoEInfo:
    """Measure the routing geometry from the model's modules (works on a meta-device model)."""
    family = _family(model)
    layers = _moe_layers(model)
    if not layers:
        raise ValueError(f"model {type(model).__name__} ({family}) has no sparse MoE layer")
    geoms = set()
    for _, block in layers:
        gate_up, _ = expert_weights(block)
        E, two_i, H = gate_up.shape
        router = block.gate
        norm = bool(getattr(router, "norm_topk_prob", False)) or _FAMILIES[family]
        geoms.add((E, int(router.top_k), norm, H, two_i // 2, hasattr(block, "shared_expert")))
    if len(geoms) != 1:
        raise ValueError(f"model {type(model).__name__}: MoE layers differ in geometry: {geoms}")
    E, k, norm, H, width, shared = geoms.pop()
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    return MoEInfo(
        family=family,
        num_layers=len(layers),
        layer_indices=tuple(i for i, _ in layers),
        num_experts=E,
        top_k=k,
        norm_topk_prob=norm,
        hidden_size=H,
        expert_width=width,
        has_shared_expert=shared,
        vocab_size=int(cfg.vocab_size),
    )


def moe_taps(model: nn.Module) -> list[tuple[nn.Module, nn.Module | None, nn.Module]]:
    """Per MoE layer: (decoder layer, its pre-MoE norm or None, its sparse block)."""
    layers = _decoder_layers(model)
    attr = _PRE_MOE_NORM[_family(model)]
    out = []
    for i, block in _moe_layers(model):
        norm = getattr(layers[i], attr) if attr is not None else None
        out.append((layers[i], norm, block))
    return out
