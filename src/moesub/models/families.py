"""Which transformers MoE families moesub reads: one adapter per family, the only code that knows
where a family keeps its sparse blocks, routers, experts and shared expert.

Supported families (transformers 5 module layout, measured on 5.24): Qwen3-Next, Qwen3-MoE,
Qwen2-MoE, OLMoE, FlexOlmo and Mixtral. All six share one layout, read by `MoEFamily` with
three per-family facts (`FAMILIES`): decoder layer `i` is `model.model.layers[i]`, its MLP is
`layer.mlp` (or `layer.block_sparse_moe`), and an MoE layer's MLP is a sparse block with

- `block.gate`: a TopKRouter with `weight [E, H]` and `top_k`, whose forward maps hidden states
  `[N, H]` to `(router_logits [N, E], weights [N, k], ids [N, k])`: softmax in float32, top-k of
  the probabilities (descending), renormalized over the k when `norm_topk_prob` (a router
  attribute; Mixtral's router always renormalizes and has none);
- `block.experts`: fused 3-D parameters `gate_up_proj [E, 2I, H]` (gate half first) and
  `down_proj [E, H, I]`, called as `experts(hidden [N, H], ids [N, k], weights [N, k])`, and
  `act_fn`;
- Qwen3-Next / Qwen2-MoE only: `block.shared_expert` (a dense MLP) and `block.shared_expert_gate`;
- the norm between the residual stream and the MoE block: `post_attention_layernorm` (FlexOlmo
  normalizes after its MLP instead: none).

Everything outside this module reads a family through its adapter (`moe_family(model)`): the
router hook (`moesub.models.routing`) hooks `router(block)` and reads and rewrites its output with
`split_route` / `join_route`; the engine takes the experts in the *engine's expert layout*
(`expert_weights`: gated experts `gate_up [E, 2I, H]`, gate half first, and `down [E, H, I]`,
`y = down @ (act(gate @ x) * (up @ x))`, the layout of its kernels and expert store) and swaps
the block's experts module (`set_experts`). A family that does not fit the shared layout is one
subclass of `MoEFamily` overriding what differs, registered in `FAMILIES`.

Everything here reads the module structure only, so it works on a meta-device model too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RouteOutput = Any  # what a family's router module returns


class MoEFamily:
    """One family's layout (the transformers-5 sparse block described in the module docstring).

    `model_type` is the family's `config.model_type`; `always_norm_topk`: the router renormalizes
    its top-k weights without a `norm_topk_prob` attribute; `pre_moe_norm`: the decoder layer's
    attribute holding the norm between the residual stream and the MoE block (None: the block
    reads the residual stream itself); `block_attrs`: the decoder layer's attributes that may
    hold the sparse block."""

    def __init__(
        self,
        model_type: str,
        *,
        always_norm_topk: bool = False,
        pre_moe_norm: str | None = "post_attention_layernorm",
        block_attrs: tuple[str, ...] = ("mlp", "block_sparse_moe"),
    ) -> None:
        self.model_type = model_type
        self.always_norm_topk = always_norm_topk
        self._pre_moe_norm = pre_moe_norm
        self.block_attrs = block_attrs

    # ------------------------------------------------------------------------- structure
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(
                f"model {type(model).__name__}: no decoder layer list at `model.model.layers`"
            )
        return layers

    def sparse_block(self, layer: nn.Module) -> nn.Module | None:
        """The decoder layer's sparse MoE block, or None (a dense layer)."""
        for attr in self.block_attrs:
            block = getattr(layer, attr, None)
            if isinstance(block, nn.Module) and self.is_sparse(block):
                return block
        return None

    def is_sparse(self, block: nn.Module) -> bool:
        """A router (`weight` tensor, `top_k`) and an experts module, whatever that holds (the
        engine's own experts module too)."""
        router = getattr(block, "gate", None)
        return (
            isinstance(router, nn.Module)
            and isinstance(getattr(router, "weight", None), torch.Tensor)
            and hasattr(router, "top_k")
            and isinstance(getattr(block, "experts", None), nn.Module)
        )

    def pre_moe_norm(self, layer: nn.Module) -> nn.Module | None:
        """The decoder layer's norm between the residual stream and its MoE block, or None."""
        return None if self._pre_moe_norm is None else getattr(layer, self._pre_moe_norm)

    def has_shared_expert(self, block: nn.Module) -> bool:
        return hasattr(block, "shared_expert")

    # ------------------------------------------------------------------------- router
    def router(self, block: nn.Module) -> nn.Module:
        """The module whose forward output `split_route` reads (hooked by `RouterHook`)."""
        return block.gate

    def top_k(self, block: nn.Module) -> int:
        return int(self.router(block).top_k)

    def norm_topk_prob(self, block: nn.Module) -> bool:
        """Whether the router renormalizes its top-k weights to sum 1."""
        return bool(getattr(self.router(block), "norm_topk_prob", False)) or self.always_norm_topk

    def split_route(self, output: RouteOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's output as (logits [N, E], weights [N, k], ids [N, k]), slot order."""
        logits, weights, ids = output
        return logits, weights, ids

    def join_route(
        self, output: RouteOutput, weights: torch.Tensor, ids: torch.Tensor
    ) -> RouteOutput:
        """The router's output with its weights and ids replaced (the block computes `ids`)."""
        return output[0], weights, ids

    def router_logits(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The logits [N, E] the router computes from its input `x [N, H]` (the lookahead)."""
        router = self.router(block)
        if router.weight.device.type != "meta" and not hasattr(router, "_hf_hook"):
            # a TopKRouter's logits are F.linear(hidden, weight): skip its softmax and top-k
            return F.linear(x, router.weight)
        return self.split_route(router(x))[0]  # Accelerate loads an offloaded weight for forward

    def check_lookahead(self, block: nn.Module) -> None:
        """Raise unless `router_logits` is the router's own logit computation."""
        name = type(self.router(block)).__name__
        if not name.endswith("TopKRouter"):
            raise ValueError(
                f"RouterHook lookahead: router {name} is not a transformers TopKRouter "
                "(logits = F.linear(hidden, weight))"
            )

    # ------------------------------------------------------------------------- experts
    def expert_weights(self, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's experts in the engine's expert layout, `(gate_up [E, 2I, H], down
        [E, H, I])` (here the fused parameters themselves, not copies)."""
        experts = getattr(block, "experts", None)
        gate_up = getattr(experts, "gate_up_proj", None)
        down = getattr(experts, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise ValueError(
                f"{type(block).__name__}: experts {type(experts).__name__} hold no fused "
                f"gate_up_proj / down_proj tensors (the {self.model_type} layout)"
            )
        E, two_i, H = gate_up.shape
        if down.shape != (E, H, two_i // 2) or two_i % 2:
            raise ValueError(
                f"{type(block).__name__}: unexpected expert layout gate_up {tuple(gate_up.shape)}, "
                f"down {tuple(down.shape)} (expected [E, 2I, H] and [E, H, I])"
            )
        return gate_up, down

    def expert_act(self, block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The experts' gate activation (`act` of the engine's expert layout)."""
        return block.experts.act_fn

    def set_experts(self, block: nn.Module, experts: nn.Module | None) -> None:
        """Put `experts` in place of the block's experts module (None: drop them). The block calls
        it as transformers-5 experts: `(hidden [N, H], ids [N, k], weights [N, k]) -> [N, H]`."""
        block.experts = experts


FAMILIES: dict[str, MoEFamily] = {
    f.model_type: f
    for f in (
        MoEFamily("qwen3_next"),
        MoEFamily("qwen3_moe"),
        MoEFamily("qwen2_moe"),
        MoEFamily("olmoe"),
        MoEFamily("flex_olmo", pre_moe_norm=None),  # normalizes after its MLP instead
        MoEFamily("mixtral", always_norm_topk=True),  # no norm_topk_prob flag
    )
}
SUPPORTED_FAMILIES = tuple(sorted(FAMILIES))


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
    # weights besides the routed experts in the decoder layers, per MoE layer (attention,
    # routers, shared experts, norms, dense layers' MLPs): what a profile prices as each MoE
    # layer's dense work (`dense_weights_per_moe_layer`)
    dense_weights_per_layer: float

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layer_indices"] = list(self.layer_indices)
        return d


def moe_family(model: nn.Module) -> MoEFamily:
    """The adapter of `model`'s family (`config.model_type`); ValueError if not supported."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        raise ValueError(
            f"model family {family!r} ({type(model).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return FAMILIES[family]


def _moe_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder-layer index, sparse block) for every MoE layer, in layer order."""
    family = moe_family(model)
    out = []
    for i, layer in enumerate(family.decoder_layers(model)):
        block = family.sparse_block(layer)
        if block is not None:
            out.append((i, block))
    if not out:
        name = type(model).__name__
        raise ValueError(f"model {name} ({family.model_type}) has no sparse MoE layer")
    return out


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of `model`, in layer order (MoE layer l is element l)."""
    return [b for _, b in _moe_layers(model)]


def moe_info(model: nn.Module) -> MoEInfo:
    """Measure the routing geometry from the model's modules (works on a meta-device model)."""
    family = moe_family(model)
    layers = _moe_layers(model)
    geoms = set()
    for _, block in layers:
        gate_up, _ = family.expert_weights(block)
        E, two_i, H = gate_up.shape
        geoms.add(
            (E, family.top_k(block), family.norm_topk_prob(block), H, two_i // 2,
             family.has_shared_expert(block))
        )  # fmt: skip
    if len(geoms) != 1:
        raise ValueError(f"model {type(model).__name__}: MoE layers differ in geometry: {geoms}")
    E, k, norm, H, width, shared = geoms.pop()
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    return MoEInfo(
        family=family.model_type,
        num_layers=len(layers),
        layer_indices=tuple(i for i, _ in layers),
        num_experts=E,
        top_k=k,
        norm_topk_prob=norm,
        hidden_size=H,
        expert_width=width,
        has_shared_expert=shared,
        vocab_size=int(cfg.vocab_size),
        dense_weights_per_layer=dense_weights_per_moe_layer(model),
    )


def dense_weights_per_moe_layer(model: nn.Module) -> float:
    """The weights a decode step reads in the decoder layers besides the routed experts
    (attention, routers, shared experts, norms, the MLPs of dense layers), over the MoE layers:
    what the pricing counts as each MoE layer's dense work (`moesub.hardware.ModelBytes`). The
    embeddings and the LM head are outside the layers. Works on a meta-device model (a
    checkpoint's check counts it so, `moesub.models.check_checkpoint`)."""
    family = moe_family(model)
    moe = _moe_layers(model)
    layers = sum(p.numel() for p in family.decoder_layers(model).parameters())
    experts = sum(t.numel() for _, block in moe for t in family.expert_weights(block))
    return (layers - experts) / len(moe)


def moe_taps(model: nn.Module) -> list[tuple[nn.Module, nn.Module | None, nn.Module]]:
    """Per MoE layer: (decoder layer, its pre-MoE norm or None, its sparse block)."""
    family = moe_family(model)
    layers = family.decoder_layers(model)
    return [(layers[i], family.pre_moe_norm(layers[i]), block) for i, block in _moe_layers(model)]
