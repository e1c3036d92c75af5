"""The embedded default model: a tiny Qwen3-Next MoE trained here, on CPU, from the stdlib.

Everything the model needs ships with every Python installation:

- **corpus** (``moesub.corpus``): the running interpreter's standard-library ``.py`` sources
  plus the English reference text of ``pydoc_data.topics``, split into train / calib / eval by
  a hash of each document's path.
- **tokenizer** (``moesub.corpus``): byte-level BPE trained with ``tokenizers`` on the train
  split, saved as a ``PreTrainedTokenizerFast`` (``AutoTokenizer.from_pretrained`` loads it).
- **model**: transformers' own ``Qwen3NextForCausalLM`` (3 linear : 1 full attention, shared
  expert) with the reference model's routing geometry (512 routed experts, top-10, renormalized)
  and small widths, trained with AdamW + cosine under a token and/or wall-clock budget.

``build_model(out_dir, params)`` writes the HF checkpoint, tokenizer, ``train_log.parquet``,
``corpus_files.parquet`` and ``train_summary.json`` into ``out_dir`` atomically.

Determinism: corpus, split and tokenizer depend on the Python installation only; weights depend
on ``seed`` and the torch thread count. A run with only a token budget (``max_tokens`` set,
``train_seconds=None``) is bit-reproducible (training runs with torch's deterministic
algorithms: the grouped_mm experts backward is otherwise thread-order dependent). Under a
wall-clock budget the cosine schedule follows the elapsed time, so the number of steps (and the
weights) vary with machine load; the steps, tokens and time actually used are recorded in
``train_summary.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import platform
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from moesub.corpus import (
    SPECIAL_TOKENS,
    SPLITS,
    CorpusDoc,
    collect_corpus,
    corpus_table,
    encode_documents,
    stdlib_dir,
    train_tokenizer,
)
from moesub.io import atomic_dir, write_json, write_parquet

BALANCE_POOLINGS = ("micro_batch", "global")
ROUTER_WEIGHT_SUFFIX = ".mlp.gate.weight"  # Qwen3-Next's TopKRouter weight [E, H]


# --------------------------------------------------------------------------------------------
# configuration


@dataclass
class EmbeddedConfig:
    """Every knob of the embedded model (config.yaml ``embedded:`` section)."""

    seed: int = 0
    # corpus split (fractions of documents, by path hash; the rest is train)
    calib_fraction: float = 0.05
    eval_fraction: float = 0.05
    # tokenizer
    vocab_size: int = 8192
    min_frequency: int = 2
    # model geometry (Qwen3NextConfig)
    hidden_size: int = 128
    num_hidden_layers: int = 4
    # the first n decoder layers use a dense MLP of the MoE layers' active width (k experts +
    # the shared expert), as DeepSeek-V3 and GLM-4.5 do: a first layer's routing is nearly
    # token-level and has no temporal locality to cache
    dense_layers: int = 0
    full_attention_interval: int = 4  # every 4th layer full attention: 3 linear : 1 full
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 16
    shared_expert_intermediate_size: int = 64
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    # how the load-balancing loss pools its statistics (see `balance_loss`): "micro_batch" is
    # transformers' built-in loss (f and P of the current micro-batch, pooled over layers);
    # "global" is per layer, with f pooled over steps by an EMA of `balance_ema_steps` steps
    balance_pooling: str = "micro_batch"
    balance_ema_steps: float = 64.0
    router_z_loss_coef: float = 0.0
    router_lr_scale: float = 1.0  # the routers' learning rate relative to `lr`
    max_position_embeddings: int = 4096
    # training
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    train_seconds: float | None = 600.0
    max_tokens: int | None = None
    eval_tokens: int = 65536  # held-out tokens scored for the perplexity (eval split)
    train_max_bytes: int | None = None  # cap the training text (tests, smoke runs); None = all
    threads: int | None = None  # torch.set_num_threads; None = leave as is
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


# --------------------------------------------------------------------------------------------
# model and training


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


def lr_at(step: int, cfg: EmbeddedConfig, progress: float) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine down to `min_lr_ratio * lr`.

    `progress` in [0, 1] is the fraction of the post-warmup budget used (see `train`).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(max(progress, 0.0), 1.0)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: torch.nn.Module, cfg: EmbeddedConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors do not; the routers' weights (``mlp.gate.weight``) learn
    at ``router_lr_scale`` times the learning rate (each group's ``lr_scale``)."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            key = (p.dim() >= 2, name.endswith(ROUTER_WEIGHT_SUFFIX))
            groups.setdefault(key, []).append(p)
    return torch.optim.AdamW(
        [
            {
                "params": params,
                "weight_decay": cfg.weight_decay if decay else 0.0,
                "lr_scale": cfg.router_lr_scale if router else 1.0,
            }
            for (decay, router), params in sorted(groups.items())
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
    )


class RouterLosses:
    """The router terms added to the language-model loss at each training step.

    - Load balancing, ``balance_pooling="global"``: per MoE layer the Switch loss
      ``E * sum_e f_e * P_e``, where ``P_e`` (mean router probability of expert e over the
      micro-batch) carries the gradient and ``f_e`` (expert e's share of the top-k selections,
      summing to k as in transformers' loss) is an EMA over the last ~``balance_ema_steps``
      steps, without gradient; mean over layers (k when perfectly balanced). This is
      global-batch balancing as Qwen3 trains: experts must be balanced over many batches, not
      within each one, so they can specialize by topic (the cache's temporal locality). With
      ``"micro_batch"`` the model's built-in loss (same formula, f and P of the micro-batch,
      pooled over layers) is used instead and nothing is computed here.
    - Router z-loss (ST-MoE): mean over layers and tokens of ``logsumexp(z)^2``.
    """

    def __init__(self, cfg: EmbeddedConfig, num_layers: int) -> None:
        self.cfg = cfg
        self.decay = 1.0 - 1.0 / cfg.balance_ema_steps
        k, E = cfg.num_experts_per_tok, cfg.num_experts
        # per layer the (E,) EMA of f (sums to k); replaced, not updated in place, each step:
        # the previous step's tensor may still be saved for a backward pass
        self.share = [torch.full((E,), k / E) for _ in range(num_layers)]

    def __call__(self, router_logits: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        terms: dict[str, torch.Tensor] = {}
        if cfg.router_z_loss_coef > 0:
            z_sq = [torch.logsumexp(z.float(), dim=-1).square().mean() for z in router_logits]
            terms["z_loss"] = torch.stack(z_sq).mean()
        if cfg.balance_pooling == "global":
            per_layer = []
            for layer, z in enumerate(router_logits):  # z: (B * seq_len, E)
                z = z.float()
                probs_mean = torch.softmax(z, dim=-1).mean(dim=0)  # (E,)
                ids = z.topk(cfg.num_experts_per_tok, dim=-1).indices  # (B * seq_len, k)
                counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
                f = counts.to(torch.float32) / z.shape[0]  # (E,) sums to k
                self.share[layer] = self.decay * self.share[layer] + (1.0 - self.decay) * f
                per_layer.append(cfg.num_experts * (self.share[layer] * probs_mean).sum())
            terms["aux_loss"] = torch.stack(per_layer).mean()
        return terms


def train(model, tokens: np.ndarray, cfg: EmbeddedConfig) -> tuple[dict[str, list], dict]:
    """Train `model` on random windows of `tokens` (int32, 1-D) within the budget.

    The cosine's progress after warmup is the larger of the token budget used and the
    wall-clock budget used, so the learning rate reaches its floor exactly when the first budget
    runs out. With only `max_tokens` the run is a pure function of the seed (and thread count).
    Returns the per-step log (step, tokens, loss, aux_loss, z_loss, lr, elapsed_s) and run
    facts; `loss` is the language-model cross-entropy alone.
    """
    if tokens.size <= cfg.seq_len:
        raise ValueError(f"corpus: {tokens.size} training tokens, fewer than seq_len={cfg.seq_len}")
    rng = np.random.default_rng([cfg.seed, 1])
    data = torch.from_numpy(tokens.astype(np.int64))
    window = torch.arange(cfg.seq_len)
    opt = _optimizer(model, cfg)
    router_losses = RouterLosses(cfg, cfg.num_hidden_layers)
    builtin_coef = cfg.router_aux_loss_coef if cfg.balance_pooling == "micro_batch" else 0.0
    model.router_aux_loss_coef = builtin_coef  # the forward adds builtin_coef * built-in loss
    max_steps = None if cfg.max_tokens is None else cfg.max_tokens // cfg.tokens_per_step
    log: dict[str, list] = {
        k: [] for k in ("step", "tokens", "loss", "aux_loss", "z_loss", "lr", "elapsed_s")
    }
    model.train()
    start = time.perf_counter()
    warm_end_s = 0.0  # elapsed time when warmup ended
    step = 0
    bar = tqdm(total=max_steps, desc="training", unit="step", mininterval=2.0)
    while True:
        elapsed = time.perf_counter() - start
        if max_steps is not None and step >= max_steps:
            break
        if cfg.train_seconds is not None and elapsed >= cfg.train_seconds:
            break
        if step == cfg.warmup_steps:
            warm_end_s = elapsed
        progress = 0.0
        if max_steps is not None:
            progress = (step - cfg.warmup_steps) / max(max_steps - cfg.warmup_steps, 1)
        if cfg.train_seconds is not None and step >= cfg.warmup_steps:
            span = max(cfg.train_seconds - warm_end_s, 1e-9)
            progress = max(progress, (elapsed - warm_end_s) / span)
        lr = lr_at(step, cfg, progress)
        for group in opt.param_groups:
            group["lr"] = lr * group["lr_scale"]
        offsets = rng.integers(0, data.numel() - cfg.seq_len, size=cfg.batch_size)
        batch = data[torch.from_numpy(offsets)[:, None] + window]  # (B, seq_len)
        out = model(input_ids=batch, labels=batch, output_router_logits=True, use_cache=False)
        builtin_aux = float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0
        ce = float(out.loss.detach()) - builtin_coef * builtin_aux
        terms = router_losses(out.router_logits)
        loss = out.loss
        if "aux_loss" in terms:
            loss = loss + cfg.router_aux_loss_coef * terms["aux_loss"]
        if "z_loss" in terms:
            loss = loss + cfg.router_z_loss_coef * terms["z_loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        aux = float(terms["aux_loss"].detach()) if "aux_loss" in terms else builtin_aux
        z_loss = float(terms["z_loss"].detach()) if "z_loss" in terms else float("nan")
        for key, value in (
            ("step", step),
            ("tokens", step * cfg.tokens_per_step),
            ("loss", ce),
            ("aux_loss", aux),
            ("z_loss", z_loss),
            ("lr", lr),
            ("elapsed_s", time.perf_counter() - start),
        ):
            log[key].append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{ce:.3f}", lr=f"{lr:.2e}", refresh=False)
    bar.close()
    model.router_aux_loss_coef = cfg.router_aux_loss_coef
    model.eval()
    facts = {
        "steps": step,
        "tokens_seen": step * cfg.tokens_per_step,
        "train_time_s": time.perf_counter() - start,
        "stopped_on": "max_tokens" if max_steps is not None and step >= max_steps else "time",
    }
    return log, facts


@contextlib.contextmanager
def _deterministic(enabled: bool) -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@torch.no_grad()
def heldout_perplexity(model, tokens: np.ndarray, seq_len: int, max_tokens: int) -> dict:
    """exp(mean NLL) over non-overlapping `seq_len` windows of held-out `tokens`.

    With more windows than `max_tokens` allows, the scored windows are spread evenly over the
    whole split (deterministically), so no single file dominates.
    """
    total_win = tokens.size // seq_len
    if total_win == 0:
        raise ValueError(f"eval split: {tokens.size} tokens, fewer than seq_len={seq_len}")
    n_win = min(total_win, max(max_tokens // seq_len, 1))
    pick = np.unique(np.linspace(0, total_win - 1, n_win).round().astype(np.int64))
    windows = tokens[: total_win * seq_len].reshape(total_win, seq_len)[pick]
    data = torch.from_numpy(windows.astype(np.int64))  # (n_win, seq_len)
    model.eval()
    total, count = 0.0, 0
    for i in tqdm(range(0, len(data), 8), desc="held-out perplexity", unit="batch"):
        x = data[i : i + 8]  # (b, seq_len)
        logits = model(input_ids=x, use_cache=False).logits.float()  # (b, seq_len, V)
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(nll)
        count += x[:, 1:].numel()
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}


# --------------------------------------------------------------------------------------------
# the pipeline entry point


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM (what schedulers send) into SystemExit so temp dirs get cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_subset(docs: list[CorpusDoc], texts: list[str], max_bytes: int | None) -> list[str]:
    """Train-split texts; with `max_bytes`, a hash-ordered subset of about that size."""
    train = [(d, t) for d, t in zip(docs, texts, strict=True) if d.split == "train"]
    if max_bytes is None:
        return [t for _, t in train]
    train.sort(key=lambda dt: hashlib.sha256(b"subset:" + dt[0].path.encode()).digest())
    out, total = [], 0
    for doc, text in train:
        if total >= max_bytes:
            break
        out.append(text)
        total += doc.nbytes
    return out


def build_model(out_dir: str | os.PathLike, params: dict[str, Any] | None = None) -> Path:
    """Build the embedded default model into `out_dir` (atomically); returns `out_dir`.

    Writes the HF checkpoint (config.json, model.safetensors), the tokenizer files,
    train_log.parquet, corpus_files.parquet and train_summary.json.
    """
    cfg = EmbeddedConfig.from_params(params)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(out_dir)
    wall0 = time.perf_counter()
    docs, texts = collect_corpus(cfg)
    train_texts = _train_subset(docs, texts, cfg.train_max_bytes)
    eval_texts = [t for d, t in zip(docs, texts, strict=True) if d.split == "eval"]
    for split, items in (("train", train_texts), ("eval", eval_texts)):
        if not items:
            raise ValueError(f"corpus: the {split} split is empty; adjust the split fractions")

    with _sigterm_raises(), atomic_dir(out) as tmp:
        corpus_meta = {"stdlib": str(stdlib_dir()), "python": platform.python_version()}
        write_parquet(corpus_table(docs), tmp / "corpus_files.parquet", metadata=corpus_meta)
        tokenizer = train_tokenizer(train_texts, cfg.vocab_size, cfg.min_frequency)
        if len(tokenizer) != cfg.vocab_size:
            raise ValueError(
                f"params: vocab_size={cfg.vocab_size} but the corpus only supports "
                f"{len(tokenizer)} tokens"
            )
        tokenizer.save_pretrained(tmp)
        eos = tokenizer.eos_token_id
        train_ids = encode_documents(tokenizer, train_texts, "tokenizing train", eos)
        eval_ids = encode_documents(tokenizer, eval_texts, "tokenizing eval", eos)

        from transformers import Qwen3NextForCausalLM

        torch.manual_seed(cfg.seed)
        model = Qwen3NextForCausalLM(model_config(cfg, tokenizer))
        n_params = sum(p.numel() for p in model.parameters())
        with _deterministic(cfg.deterministic):
            log, facts = train(model, train_ids, cfg)
        write_parquet(log, tmp / "train_log.parquet", metadata={"config": dataclasses.asdict(cfg)})
        ppl = heldout_perplexity(model, eval_ids, cfg.seq_len, cfg.eval_tokens)
        model.save_pretrained(tmp)
        summary = {
            "config": dataclasses.asdict(cfg),
            **facts,
            "tokens_per_s": facts["tokens_seen"] / max(facts["train_time_s"], 1e-9),
            "final_train_loss": log["loss"][-1] if log["loss"] else None,
            "heldout_perplexity": ppl["perplexity"],
            "heldout_nll": ppl["nll"],
            "heldout_tokens": ppl["tokens"],
            "num_parameters": n_params,
            "corpus": {
                s: {
                    "files": sum(d.split == s for d in docs),
                    "bytes": sum(d.nbytes for d in docs if d.split == s),
                }
                for s in SPLITS
            },
            "train_corpus_tokens": int(train_ids.size),
            "eval_corpus_tokens": int(eval_ids.size),
            "python": platform.python_version(),
            "stdlib": str(stdlib_dir()),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "build_seconds": time.perf_counter() - wall0,
        }
        write_json(summary, tmp / "train_summary.json")
    return out
