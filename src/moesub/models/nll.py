"""The exact teacher-forced NLL: one forward per batch of equal-length streams.

Capture, emulation and Experiment B all score streams with these two functions, so their NLL
agree bit for bit: same batching (`stream_batches`), same forward and log-softmax (`stream_nll`).
"""

from __future__ import annotations

import itertools
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
def stream_nll(model: nn.Module, input_ids: torch.Tensor) -> np.ndarray:
    """Per-token NLL `[B, T]` float64 (NaN at position 0) from ONE teacher-forced forward.

    The single forward used by capture and emulate (bit-exactness between them depends on it):
    the model's decoder (`model.base_model`, `use_cache=False`) in the model's dtype, then its
    output head on `head_rows(V, device)` of the B*T hidden states at a time, each chunk's
    logits log-softmaxed in float32 and cast to float64. This is `model(input_ids)` without
    its [B, T, V] logits tensor: with a real vocabulary the largest tensor of the forward (B*T
    = 2048, V = 151936: 1.2 GiB of float32); on the embedded shape its fresh pages and the
    log-softmax's second pass over it made the NLL cost 5-8% of a plain forward, the chunks
    (in cache) make forward + NLL 0.95-1.00x one (benchmarks/bench_capture.py).

    A matmul's bits can depend on its row count: no chunk is shorter than `head_rows` (the
    remainder joins the last one), and at that height the CPU head gives the bits of one [B*T,
    V] matmul (measured, float32: rows differ only in chunks under 12 rows), so the NLL equals
    that of `model(input_ids).logits` (tests/test_models.py). The batch composition (B, T)
    must match too for bit-identical results.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    device = input_device(model)
    ids = input_ids.to(device=device, dtype=torch.long)  # [B, T]
    B, T = ids.shape
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # [B, T, H]
    hidden = hidden.reshape(B * T, -1)  # [N, H], batch-major like the targets below
    head = model.get_output_embeddings()
    # row n = (b, t) predicts ids[b, t + 1]; each stream's last row predicts nothing (0)
    targets = torch.cat([ids[:, 1:], ids.new_zeros(B, 1)], dim=1).reshape(-1)  # [N]
    rows = head_rows(head.out_features, device)
    bounds = [*range(0, max(B * T - rows, 1), rows), B * T]  # the last chunk: rows..2*rows-1
    nll = torch.empty(B * T, dtype=torch.float64)  # [N]
    for s, e in itertools.pairwise(bounds):
        logits = head(hidden[s:e])  # [e - s, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = lp.gather(-1, targets[s:e, None].to(lp.device)).squeeze(-1)  # [e - s]
        nll[s:e] = -tok.double().cpu()
    out = torch.full((B, T), float("nan"), dtype=torch.float64)
    out[:, 1:] = nll.reshape(B, T)[:, :-1]
    return out.numpy()


def head_rows(vocab_size: int, device: torch.device) -> int:
    """Rows of hidden states per output-head chunk in `stream_nll`: about 2^18 logits on CPU
    (the chunk's logits and log-probabilities stay in cache), 2^26 on an accelerator, and at
    least 64 (tall enough to be compute-bound, and on CPU to give one big matmul's bits)."""
    budget = 2**18 if device.type == "cpu" else 2**26
    return max(64, budget // vocab_size)
