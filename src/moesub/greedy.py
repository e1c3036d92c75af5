"""Greedy decoding under a policy on the emulator: one prompt at a time (`greedy_decode`, with
stop tokens) or a batch of fixed-length continuations (`greedy_decode_batched`), each prompt with
fresh per-layer caches (`moesub.replay.policy_router`); the exact model where `policy` is None.
The engine's counterpart is `moesub.engine.generate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moesub.models import cached_forward, input_device
from moesub.replay import (
    BatchRouter,
    forward_step,
    policy_router,
    replay_policy,
    router_context,
)


@dataclass
class DecodeResult:
    """One greedy continuation: generated tokens (stop token excluded) and, per token, the
    substituted gate mass (summed over layers) of the forward step that produced it."""

    tokens: list[int]
    mass: list[float]
    stopped: bool  # True when a stop token ended it (before max_new_tokens)


@torch.inference_mode()
def greedy_decode(
    model,
    prompts: list[list[int]],
    policy,
    capacity: int | Sequence[int],
    initial: Any,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    progress: bool = False,
    coactivation: np.ndarray | None = None,
) -> list[DecodeResult]:
    """Greedy decoding with the KV cache under `policy` (None = the exact model).

    Each prompt gets fresh per-layer caches; the prompt is prefilled as one chunk through the
    same `LayerCache`s that then see one row per generated token. `coactivation`: the table a
    substitute_by='coactivation' policy needs (`make_caches`).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if policy is not None:
        policy = replay_policy(policy)
    device = input_device(model)
    results = []
    for prompt in tqdm(prompts, desc="decode", unit="prompt", disable=not progress):
        if len(prompt) == 0:
            raise ValueError("prompts: every prompt needs at least one token")
        router = (
            None
            if policy is None
            else policy_router(model, policy, capacity, initial, coactivation)
        )
        tokens: list[int] = []
        masses: list[float] = []
        stopped = False
        with router_context(model, router):
            step_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, P)
            cache = None
            while len(tokens) < max_new_tokens:
                logits, cache = forward_step(model, step_ids, cache)
                nxt = int(torch.argmax(logits))
                if nxt in stop_ids:
                    stopped = True
                    break
                tokens.append(nxt)
                masses.append(0.0 if router is None else router.last_mass())
                step_ids = torch.tensor([[nxt]], dtype=torch.long, device=device)
        results.append(DecodeResult(tokens=tokens, mass=masses, stopped=stopped))
    return results


@torch.inference_mode()
def greedy_decode_batched(
    model,
    prompts: list[list[int]],
    policy,
    capacity: int | Sequence[int],
    initial: np.ndarray | None,
    max_new_tokens: int,
    batch_size: int | None = None,
    progress: bool = False,
    coactivation: np.ndarray | None = None,
) -> list[DecodeResult]:
    """Greedy decoding of equal-length prompts, exactly `max_new_tokens` tokens each (no stop
    token), `batch_size` prompts per forward (None: all) under `policy` (None = the exact model).

    Each prompt is its own stream with its own fresh per-layer caches, as in `greedy_decode`:
    a forward over B prompts hands each prompt's rows to its own `PolicyRouter`
    (`BatchRouter`), so every cache decision is the one that prompt gets alone. Equal lengths
    and no stop keep the batch rectangular (no padding, no row that steps a cache for
    nothing). Only the forward's floating-point rounding depends on the batch's shape (the last
    bits of a logit), so a prompt decoded alone can differ where two logits nearly tie: compare
    policies decoded with the same batches.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
    if len({len(p) for p in prompts}) > 1 or any(len(p) == 0 for p in prompts):
        raise ValueError(
            "prompts: batched decoding needs non-empty prompts of one length, got lengths "
            f"{sorted({len(p) for p in prompts})}"
        )
    if policy is not None:
        policy = replay_policy(policy)
    device = input_device(model)
    size = batch_size or max(len(prompts), 1)
    results = []
    bar = tqdm(total=len(prompts) * max_new_tokens, desc="decode", unit="tok", disable=not progress)
    for lo in range(0, len(prompts), size):
        batch = prompts[lo : lo + size]
        routers = (
            None
            if policy is None
            else [policy_router(model, policy, capacity, initial, coactivation) for _ in batch]
        )
        tokens = np.zeros((len(batch), max_new_tokens), dtype=np.int64)  # (B, N)
        masses = np.zeros((len(batch), max_new_tokens))  # (B, N) summed over layers
        with router_context(model, None if routers is None else BatchRouter(routers)):
            step_ids = torch.tensor(batch, dtype=torch.long, device=device)  # (B, P), then (B, 1)
            cache = None
            for i in range(max_new_tokens):
                out, cache = cached_forward(model, step_ids, cache)
                nxt = torch.argmax(out.logits[:, -1].to(torch.float64), dim=-1)  # (B,)
                tokens[:, i] = nxt.cpu().numpy()
                if routers is not None:
                    masses[:, i] = [r.last_mass() for r in routers]
                step_ids = nxt[:, None]
                bar.update(len(batch))
        results += [
            DecodeResult(tokens=t.tolist(), mass=m.tolist(), stopped=False)
            for t, m in zip(tokens, masses, strict=True)
        ]
    bar.close()
    return results
