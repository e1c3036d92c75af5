"""The router seam: observe or replace each MoE layer's routing during a forward.

A forward hook on each MoE layer's router (the family adapter's `router(block)`) that returns its
output with new ids (`join_route`) makes the sparse block compute expert `new_ids[n, j]` with
slot weight `weights[n, j]`: this is how substitution and cache-aware routing are emulated
(`RouterHook`, optionally with each layer's lookahead logits).
`align_ids` maps the policy core's per-rank decisions onto the model's slot order, and
`router_weights` gives the slot weights the router would give any k experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from moesub.models.families import moe_blocks, moe_family, moe_taps
from moesub.models.loading import execution_device

RouteFn = Callable[..., Any]  # (layer, logits, weights, ids[, lookahead]) -> see RouterHook


def router_weights(
    logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool
) -> torch.Tensor:
    """The slot weights a TopKRouter gives experts `experts [N, k]` (slot order) from its logits
    `[N, E]`: softmax in float32 over all E, gathered, renormalized over the k when
    `norm_topk_prob`, cast to the logits' dtype. For the router's own top-k these are its weights
    bit for bit; cache-aware routing (route_bias) computes a rerouted row's weights with it."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(1, experts.to(device=probs.device, dtype=torch.long))
    if norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


class RouterHook:
    """Context manager: call `on_route` at every MoE layer's router, optionally replacing ids.

    `on_route(layer, logits, weights, ids)` gets the MoE layer index `l` (0..L-1), the router
    logits `[N, E]` as float32 (N = B*T rows, row-major over (batch, time); do not modify),
    the slot weights `[N, k]` and selected ids `[N, k]` in the model's slot order. It returns
    None (keep the model's choice), replacement ids `[N, k]` in the same slot order (slot j
    then computes expert `new[n, j]` with the unchanged weight `weights[n, j]`), or a pair
    `(weights, ids)` replacing both (cache-aware routing selects other experts).
    With `on_route` returning None or the same ids, the model's output is bit-identical.

    `lookahead=True` also passes each layer's lookahead logits `[N, E]` float32 as a fifth
    argument (docs/policy-semantics.md, v2 `prefetch`): layer l's router applied, through layer
    l's own pre-MoE norm, to the residual stream entering MoE layer l-1's MoE sub-block (for
    MoE layer 0: the residual stream entering its decoder layer), recorded by forward pre-hooks
    during the same forward. Norm and router are the model's own modules, called on that
    stream: the lookahead is exactly what the router would compute one MoE layer earlier.
    """

    def __init__(self, model: nn.Module, on_route: RouteFn, lookahead: bool = False):
        self.family = moe_family(model)
        self.blocks = moe_blocks(model)
        if lookahead:
            for block in self.blocks:
                self.family.check_lookahead(block)
        self.model = model
        self.on_route = on_route
        self.lookahead = bool(lookahead)
        self._taps = moe_taps(model) if self.lookahead else []
        self._handles: list[Any] = []
        self._streams: list[torch.Tensor | None] = []  # [entering MoE layer 0's decoder layer,
        # entering MoE layer 0's MoE sub-block, ..., layer L-2's]: lookahead sources
        self._inner = False  # True while the hook itself runs a norm / router (no recording)

    def _make_hook(self, layer: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._inner:
                return None
            logits, weights, ids = self.family.split_route(output)  # [N, E], [N, k], [N, k]
            if self.lookahead:
                y = self._lookahead_logits(layer, logits.device)
                new = self.on_route(layer, logits.float(), weights, ids, y)
            else:
                new = self.on_route(layer, logits.float(), weights, ids)
            if new is None:
                return None
            if isinstance(new, tuple):
                new_weights, new = new
                new_weights = torch.as_tensor(new_weights, device=weights.device)
                new_weights = new_weights.to(weights.dtype)
                if new_weights.shape != weights.shape:
                    raise ValueError(
                        f"on_route for layer {layer} returned weights of shape "
                        f"{tuple(new_weights.shape)}, expected {tuple(weights.shape)}"
                    )
            else:
                new_weights = weights
            new = torch.as_tensor(new, device=ids.device).to(ids.dtype)
            if new.shape != ids.shape:
                raise ValueError(
                    f"on_route for layer {layer} returned ids of shape {tuple(new.shape)}, "
                    f"expected {tuple(ids.shape)}"
                )
            return self.family.join_route(output, new_weights, new)

        return hook

    def _make_tap(self, index: int, kwarg: str | None):
        """Forward pre-hook keeping a module's input (the residual stream) as source `index`."""

        def tap(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._inner:
                return None
            x = args[0] if args else kwargs[kwarg] if kwarg else None
            if x is None:
                raise RuntimeError(f"{type(module).__name__}: no hidden-state input to record")
            self._streams[index] = x.detach()
            return None

        return tap

    def _lookahead_logits(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer `layer`'s lookahead logits `[N, E]` float32 from its recorded source stream."""
        source = self._streams[layer]
        if source is None:
            raise RuntimeError(f"lookahead of MoE layer {layer}: its residual stream was not seen")
        self._streams[layer] = None  # each source feeds one layer: free it
        _decoder, norm, block = self._taps[layer]
        self._inner = True
        try:
            x = source
            if norm is not None:
                x = norm(x.to(execution_device(norm, x.device)))
            router = self.family.router(block)
            x = x.to(execution_device(router, x.device)).reshape(-1, x.shape[-1])
            y = self.family.router_logits(block, x)
        finally:
            self._inner = False
        return y.float().to(device)

    def __enter__(self) -> RouterHook:
        if self._handles:
            raise RuntimeError("RouterHook is already installed")
        for layer, block in enumerate(self.blocks):
            router = self.family.router(block)
            self._handles.append(router.register_forward_hook(self._make_hook(layer)))
        if self.lookahead:
            L = len(self._taps)
            self._streams = [None] * L
            decoder0 = self._taps[0][0]
            self._handles.append(
                decoder0.register_forward_pre_hook(
                    self._make_tap(0, "hidden_states"), with_kwargs=True
                )
            )
            for m in range(L - 1):  # the last MoE layer's stream is no layer's source
                _decoder, norm, block = self._taps[m]
                module = norm if norm is not None else block
                self._handles.append(
                    module.register_forward_pre_hook(self._make_tap(m + 1, None), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._streams = []


def align_ids(
    model_ids: torch.Tensor,
    selected: torch.Tensor | np.ndarray,
    computed: torch.Tensor | np.ndarray,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map the policy core's per-rank result onto the model's slot order.

    `selected[n, r]` is the core's rank-r expert (top-k by logit, ties to the lower id) and
    `computed[n, r]` the expert it actually computes for that rank; `model_ids[n, j]` is the
    model's slot-j expert. Returns `new[n, j] = computed[n, r]` where `selected[n, r] ==
    model_ids[n, j]` (vectorised), on `model_ids`' device and dtype.

    The two selections are the same SET except at an exact tie at the k-th place (two experts
    with equal router probability; the model's `torch.topk` may break it either way). Without
    `logits` such a row raises ValueError. With `logits` `[N, E]` (the router logits the hook
    received) a row whose differing experts have identical probabilities is resolved by giving
    the model's tied slot the core's tied rank (the slot weight is the same either way); any
    other mismatch still raises.
    """
    sel = torch.as_tensor(selected, device=model_ids.device).long()  # [N, k]
    comp = torch.as_tensor(computed, device=model_ids.device).to(model_ids.dtype)  # [N, k]
    mid = model_ids.long()  # [N, k]
    if sel.shape != mid.shape or comp.shape != mid.shape:
        raise ValueError(
            f"align_ids: shapes differ: model_ids {tuple(mid.shape)}, selected "
            f"{tuple(sel.shape)}, computed {tuple(comp.shape)}"
        )
    eq = mid[:, :, None] == sel[:, None, :]  # [N, k(slot), k(rank)]
    ok = eq.sum(-1) == 1  # [N, k]
    rank = eq.to(torch.int8).argmax(-1)  # [N, k]: matching rank per slot
    bad = (~ok.all(-1)).nonzero().flatten()
    if bad.numel():
        if logits is None:
            n = int(bad[0])
            raise ValueError(
                f"align_ids: {bad.numel()} row(s) where the model's top-k set differs from the "
                f"policy core's (a tie at the k-th place), e.g. row {n}: model "
                f"{sorted(mid[n].tolist())} vs core {sorted(sel[n].tolist())}; pass the "
                "router logits to resolve exact ties"
            )
        rank = _resolve_ties(mid, sel, eq, rank, bad, logits)
    return comp.gather(1, rank)


def _resolve_ties(mid, sel, eq, rank, bad, logits):
    probs = torch.softmax(logits.float(), dim=-1)  # as the router computes them, all rows
    rank = rank.clone()
    for n in bad.tolist():  # rare rows only
        slots = (eq[n].sum(-1) != 1).nonzero().flatten()  # model slots without a match
        ranks = (eq[n].sum(0) != 1).nonzero().flatten()  # core ranks without a match
        p_model = probs[n, mid[n, slots]]
        p_core = probs[n, sel[n, ranks]]
        if (
            len(slots) != len(ranks)
            or (eq[n].sum(-1) > 1).any()
            or not torch.equal(p_model, p_model[0].expand_as(p_model))
            or not torch.equal(p_core, p_model[0].expand_as(p_core))
        ):
            raise ValueError(
                f"align_ids: row {n}: the model's top-k set {sorted(mid[n].tolist())} differs "
                f"from the policy core's {sorted(sel[n].tolist())} and not by an exact tie"
            )
        rank[n, slots] = ranks
    return rank
