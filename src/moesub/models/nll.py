"""The exact teacher-forced NLL: one forward per batch of equal-length streams.

Capture, emulation and Experiment B all score streams with these two functions, so their NLL
agree bit for bit: same batching (`stream_batches`), same forward and log-softmax (`stream_nll`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from moesub.models.loading import input_device


def stream_batches(lengths: Sequence[int], batch_tokens: int | None) -> list[list[int]]:
    """Group streams into teacher-forced forward batches: runs of consecutive streams of equal
    length, at most `batch_tokens` tokens per batch (always >= 1 stream); None = one stream per
    forward. Capture, emulation and Experiment B batch with this one function and the capture's
    `batch_tokens`: the (B, T) of every forward must match for bit-identical NLL."""
    if batch_tokens is not None and (isinstance(batch_tokens, bool) or int(batch_tokens) < 1):
        raise ValueError(f"batch_tokens must be an integer >= 1 or None, got {batch_tokens!r}")
    batches: list[list[int]] = []
    for i, n in enumerate(lengths):
        last = batches[-1] if batches else None
        if (
            last is not None
            and batch_tokens is not None
            and lengths[last[0]] == n
            and (len(last) + 1) * n <= batch_tokens
        ):
            last.append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def stream_nll(model: nn.Module, input_ids: torch.Tensor, chunk: int | None = None) -> np.ndarray:
    """Per-token NLL `[B, T]` float64 (NaN at position 0) from ONE teacher-forced forward.

    The single forward used by capture and emulate (bit-exactness between them depends on it):
    `model(input_ids, use_cache=False)` in the model's dtype, then log-softmax in float32 over
    the vocabulary, cast to float64. The log-softmax runs over `chunk` positions at a time
    (default: about 2^18 logits per chunk on CPU, 2^26 on GPU); results do not depend on it.
    On CPU, small chunks matter: one [T, V] log-softmax buffer made the NLL cost 23% of a
    forward of the tiny model (fresh large allocations page-fault), 32-row chunks 4%.
    Note: the batch composition (B, T) must also match for bit-identical results.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    device = input_device(model)
    ids = input_ids.to(device=device, dtype=torch.long)  # [B, T]
    logits = model(input_ids=ids, use_cache=False).logits  # [B, T, V]
    B, T, V = logits.shape
    targets = ids.to(logits.device)  # a placed model's head may sit on another device
    if chunk is None:
        budget = 2**18 if device.type == "cpu" else 2**26
        chunk = max(1, budget // (B * V))
    out = torch.full((B, T), float("nan"), dtype=torch.float64)
    for s in range(0, T - 1, chunk):
        e = min(s + chunk, T - 1)
        lp = torch.log_softmax(logits[:, s:e].float(), dim=-1)  # [B, e-s, V]
        tok = lp.gather(-1, targets[:, s + 1 : e + 1, None]).squeeze(-1)  # [B, e-s]
        out[:, s + 1 : e + 1] = -tok.double().cpu()
    return out.numpy()
