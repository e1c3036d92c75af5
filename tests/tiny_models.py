"""The one builder of tiny random Qwen3-Next models for the tests (3 linear : 1 full attention
by default, shared expert, renormalized top-k). Router and expert weights can be scaled up so
that routing is decisive and a substitution visibly changes later layers."""

from __future__ import annotations

import numpy as np
import polars as pl
import torch
import transformers as tf

from moesub.models import moe_blocks


def tiny_qwen3_next(
    *,
    vocab: int,
    layers: int,
    experts: int,
    k: int,
    hidden: int = 32,
    expert_width: int = 8,
    layer_types: list[str] | None = None,
    special_tokens: bool = True,
    gate_std: float = 0.5,
    expert_std: float | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """A random model in eval mode: seeded, so the same arguments give the same weights."""
    torch.manual_seed(seed)
    extra = {"layer_types": layer_types} if layer_types else {}
    if special_tokens:
        extra.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    cfg = tf.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=hidden, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=48, num_hidden_layers=layers, head_dim=16, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=expert_width,
        shared_expert_intermediate_size=8, norm_topk_prob=True, **extra,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    for block in moe_blocks(model):
        torch.nn.init.normal_(block.gate.weight, std=gate_std)
        if expert_std is not None:
            torch.nn.init.normal_(block.experts.gate_up_proj, std=expert_std)
            torch.nn.init.normal_(block.experts.down_proj, std=expert_std)
    return model


def random_streams(lengths: list[int], vocab: int, seed: int = 0) -> pl.DataFrame:
    """A streams table (`moesub.streams` columns): one document per stream, random token ids in
    [3, vocab) (0-2 are the special tokens)."""
    rng = np.random.default_rng(seed)
    return pl.concat(
        pl.DataFrame(
            {
                "stream": np.full(n, s, np.int32),
                "pos": np.arange(n, dtype=np.int32),
                "token_id": rng.integers(3, vocab, n).astype(np.int32),
                "doc_id": np.full(n, s, np.int32),
                "doc_start": np.arange(n) == 0,
            }
        )
        for s, n in enumerate(lengths)
    )
