"""The embedded model's recipe: `EmbeddedConfig` (the config's `model.embedded` params, checked)
and the transformers `Qwen3NextConfig` it builds (`model_config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moesub.config import schema_defaults
from moesub.corpus import SPECIAL_TOKENS

BALANCE_POOLINGS = ("micro_batch", "global")


_DEFAULTS = schema_defaults("embedded")  # workflow/schemas/config.schema.yaml


@dataclass
class EmbeddedConfig:
    """Every knob of the embedded model (config.yaml ``embedded:`` section)."""

    seed: int = _DEFAULTS["seed"]
    # corpus split (fractions of documents, by path hash; the rest is train)
    calib_fraction: float = _DEFAULTS["calib_fraction"]
    eval_fraction: float = _DEFAULTS["eval_fraction"]
    # tokenizer
    vocab_size: int = _DEFAULTS["vocab_size"]
    min_frequency: int = _DEFAULTS["min_frequency"]
    # model geometry (Qwen3NextConfig)
    hidden_size: int = _DEFAULTS["hidden_size"]
    num_hidden_layers: int = _DEFAULTS["num_hidden_layers"]
    # the first n decoder layers use a dense MLP of the MoE layers' active width (k experts +
    # the shared expert), as DeepSeek-V3 and GLM-4.5 do: a first layer's routing is nearly
    # token-level and has no temporal locality to cache
    dense_layers: int = _DEFAULTS["dense_layers"]
    # every n-th layer full attention, the others linear attention
    full_attention_interval: int = _DEFAULTS["full_attention_interval"]
    num_attention_heads: int = _DEFAULTS["num_attention_heads"]
    num_key_value_heads: int = _DEFAULTS["num_key_value_heads"]
    head_dim: int = _DEFAULTS["head_dim"]
    linear_num_key_heads: int = _DEFAULTS["linear_num_key_heads"]
    linear_num_value_heads: int = _DEFAULTS["linear_num_value_heads"]
    linear_key_head_dim: int = _DEFAULTS["linear_key_head_dim"]
    linear_value_head_dim: int = _DEFAULTS["linear_value_head_dim"]
    num_experts: int = _DEFAULTS["num_experts"]
    num_experts_per_tok: int = _DEFAULTS["num_experts_per_tok"]
    moe_intermediate_size: int = _DEFAULTS["moe_intermediate_size"]
    shared_expert_intermediate_size: int = _DEFAULTS["shared_expert_intermediate_size"]
    norm_topk_prob: bool = _DEFAULTS["norm_topk_prob"]
    router_aux_loss_coef: float = _DEFAULTS["router_aux_loss_coef"]
    # how the load-balancing loss pools its statistics (see `balance_loss`): "micro_batch" is
    # transformers' built-in loss (f and P of the current micro-batch, pooled over layers);
    # "global" is per layer, with f pooled over steps by an EMA of `balance_ema_steps` steps
    balance_pooling: str = _DEFAULTS["balance_pooling"]
    balance_ema_steps: float = _DEFAULTS["balance_ema_steps"]
    router_z_loss_coef: float = _DEFAULTS["router_z_loss_coef"]
    # the routers' learning rate relative to `lr`
    router_lr_scale: float = _DEFAULTS["router_lr_scale"]
    max_position_embeddings: int = _DEFAULTS["max_position_embeddings"]
    # training
    seq_len: int = _DEFAULTS["seq_len"]
    batch_size: int = _DEFAULTS["batch_size"]
    lr: float = _DEFAULTS["lr"]
    min_lr_ratio: float = _DEFAULTS["min_lr_ratio"]
    warmup_steps: int = _DEFAULTS["warmup_steps"]
    weight_decay: float = _DEFAULTS["weight_decay"]
    beta1: float = _DEFAULTS["beta1"]
    beta2: float = _DEFAULTS["beta2"]
    grad_clip: float = _DEFAULTS["grad_clip"]
    train_seconds: float | None = _DEFAULTS["train_seconds"]
    max_tokens: int | None = _DEFAULTS["max_tokens"]
    # held-out tokens scored for the perplexity (eval split)
    eval_tokens: int = _DEFAULTS["eval_tokens"]
    # cap the training text (tests, smoke runs); None = all
    train_max_bytes: int | None = _DEFAULTS["train_max_bytes"]
    threads: int | None = _DEFAULTS["threads"]  # torch.set_num_threads; None = leave as is
    # torch deterministic algorithms while training: the default grouped_mm experts backward
    # accumulates gradients in a thread-dependent order otherwise
    deterministic: bool = True

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> EmbeddedConfig:
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in params:
            if key not in known:
                raise ValueError(
                    f"params: unknown embedded-model key {key!r} (known: {sorted(known)})"
                )
        cfg = cls(**params)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"params: {msg}")

        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "full_attention_interval",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "batch_size",
            "min_frequency", "eval_tokens", "max_position_embeddings",
        ]  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            need(
                isinstance(value, int) and value > 0,
                f"{name} must be a positive int, got {value!r}",
            )
        need(isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}")
        need(
            self.vocab_size >= 256 + len(SPECIAL_TOKENS),
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)",
        )
        need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok > num_experts")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_attention_heads must be a multiple of num_key_value_heads",
        )
        need(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            "linear_num_value_heads must be a multiple of linear_num_key_heads",
        )
        need(self.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size < 0")
        need(
            isinstance(self.dense_layers, int) and 0 <= self.dense_layers < self.num_hidden_layers,
            "dense_layers must be an int in [0, num_hidden_layers): at least one MoE layer",
        )
        need(isinstance(self.seq_len, int) and self.seq_len >= 2, "seq_len must be an int >= 2")
        need(self.seq_len <= self.max_position_embeddings, "seq_len > max_position_embeddings")
        for name in ("calib_fraction", "eval_fraction"):
            value = getattr(self, name)
            need(0 < value < 1, f"{name} must be in (0, 1), got {value!r}")
        need(self.calib_fraction + self.eval_fraction < 1, "calib + eval fractions must be < 1")
        need(self.lr > 0, f"lr must be > 0, got {self.lr!r}")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio must be in [0, 1]")
        need(self.warmup_steps >= 0, "warmup_steps must be >= 0")
        need(self.router_aux_loss_coef >= 0, "router_aux_loss_coef must be >= 0")
        need(
            self.balance_pooling in BALANCE_POOLINGS,
            f"balance_pooling must be one of {BALANCE_POOLINGS}, got {self.balance_pooling!r}",
        )
        need(self.balance_ema_steps >= 1, "balance_ema_steps must be >= 1")
        need(self.router_z_loss_coef >= 0, "router_z_loss_coef must be >= 0")
        need(self.router_lr_scale > 0, "router_lr_scale must be > 0")
        need(self.grad_clip > 0, "grad_clip must be > 0")
        need(
            self.train_seconds is not None or self.max_tokens is not None,
            "set train_seconds and/or max_tokens (a training budget)",
        )
        need(
            self.train_seconds is None or self.train_seconds > 0,
            f"train_seconds must be > 0, got {self.train_seconds!r}",
        )
        need(
            self.max_tokens is None or self.max_tokens >= self.tokens_per_step,
            f"max_tokens must be >= batch_size * seq_len = {self.tokens_per_step}",
        )
        need(self.threads is None or self.threads > 0, "threads must be > 0")
        need(
            self.train_max_bytes is None or self.train_max_bytes > 0,
            "train_max_bytes must be > 0 (or None)",
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def layer_types(self) -> list[str]:
        n = self.full_attention_interval
        return [
            "full_attention" if (i + 1) % n == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]


def model_config(cfg: EmbeddedConfig, tokenizer):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        # dense MLP of the first `dense_layers` layers: the MoE layers' active width
        intermediate_size=cfg.num_experts_per_tok * cfg.moe_intermediate_size
        + cfg.shared_expert_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        layer_types=cfg.layer_types(),
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        max_position_embeddings=cfg.max_position_embeddings,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(cfg.dense_layers)),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
