"""Training the embedded model: AdamW + warmup/cosine (`lr_at`) under a token and/or wall-clock
budget, the routers' balance and z losses (`RouterLosses`), and the held-out perplexity."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from moesub.embedded.config import EmbeddedConfig

ROUTER_WEIGHT_SUFFIX = ".mlp.gate.weight"  # Qwen3-Next's TopKRouter weight [E, H]


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
