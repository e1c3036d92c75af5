"""Synthetic router-logit traces with the shape and statistics of a real MoE router.

Used where no captured trace exists (benchmarks, the engine's real-size benchmark): per layer, a
skewed expert popularity (some experts are chosen far more often), topics that persist over
segments of tokens and shift which experts win, and token-to-token correlated noise (temporal
locality: consecutive tokens share many of their top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyntheticRouting:
    # Defaults give what the reference study saw on Qwen3-Next-80B-A3B (E=512, k=10, C=128):
    # a ~92% hit rate when fetching every miss, consecutive tokens sharing ~37% of their top-k.
    popularity_scale: float = 0.8  # std of the per-expert popularity bias (skew)
    topic_scale: float = 1.0  # std of the per-topic expert preference
    mean_topic_len: int = 200  # tokens between topic changes (geometric)
    n_topics: int = 8
    locality: float = 0.4  # AR(1) coefficient of the per-token noise across consecutive tokens
    noise_scale: float = 1.0
    sharpness: float = 2.0  # logit scale: how peaked the gate weights are


def synthetic_logits(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    seed: int = 0,
    routing: SyntheticRouting = SyntheticRouting(),
) -> np.ndarray:
    """float32 (T, L, E) router logits; deterministic in `seed`."""
    if min(num_tokens, num_layers, num_experts) < 1:
        raise ValueError("num_tokens, num_layers and num_experts must all be >= 1")
    rng = np.random.default_rng(seed)
    T, L, E = num_tokens, num_layers, num_experts
    popularity = rng.normal(0.0, routing.popularity_scale, size=(L, E))
    topics = rng.normal(0.0, routing.topic_scale, size=(routing.n_topics, L, E))
    # topic of each token: segments of geometric length
    changes = rng.random(T) < 1.0 / max(routing.mean_topic_len, 1)
    topic_of = rng.integers(0, routing.n_topics, size=int(changes.sum()) + 1)[np.cumsum(changes)]
    # AR(1) noise: x_t = a x_{t-1} + sqrt(1 - a^2) eps_t keeps unit variance
    a = routing.locality
    eps = rng.standard_normal((T, L, E))
    noise = np.empty((T, L, E))
    noise[0] = eps[0]
    b = np.sqrt(1.0 - a * a)
    for t in range(1, T):
        noise[t] = a * noise[t - 1] + b * eps[t]
    logits = popularity[None] + topics[topic_of] + routing.noise_scale * noise
    logits *= routing.sharpness
    return logits.astype(np.float32)
