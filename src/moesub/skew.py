"""Expert popularity skew: how much of a layer's routing its hottest experts cover, the real
reference model's figures, and share curves with the real model's skew at any E.

A cache's hits come from two sources: static skew (a few experts are chosen by most tokens, so
any fixed set of them hits often) and temporal locality (the experts a token needs were used a
few tokens ago). A pin list or an initial set only exploits the first. Two per-layer measures of
static skew, over a trace's top-k selection counts:

- ``effective_experts``: exp of the entropy of the selection shares (E for uniform use, 1 for
  one expert);
- ``top_coverage``: the share of selections that go to the C most selected experts, what a
  static C-expert set would hit at best (in sample).

The real reference model, Qwen3-Next-80B-A3B, routes far less skewed than the embedded model at
a similar LRU hit rate (docs/model-regime.md); its per-layer figures are `REAL_EFFECTIVE_EXPERTS`
and `REAL_TOP_COVERAGE` (source in `REAL_SOURCE`). `target_shares` turns them into a full
rank-share curve per layer of a model with L layers and E experts: the real layers at the same
relative depth, their mean figures, and the two-parameter curve (`ShareCurve`) that has them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import norm

REAL_MODEL = "Qwen3-Next-80B-A3B"
REAL_SOURCE = (
    "doramirdor/mbolt@94961c1 results/colibri-119/coactivation_qwen3-next-80b-a3b.json (MIT): "
    "per-layer top-10 selection counts of Qwen3-Next-80B-A3B (IQ3_XXS GGUF) over 24,963 decode "
    "tokens"
)
REAL_NUM_EXPERTS = 512
REAL_CAPACITY = 128  # the study's C: 25% of 512 resident
# exp(entropy) of each layer's selection shares and the share of its 128 most selected experts,
# layers 0..47, computed from REAL_SOURCE's `heat` arrays
# fmt: off
REAL_EFFECTIVE_EXPERTS = (
    427.0, 354.2, 427.1, 329.3, 330.5, 361.3, 393.4, 382.9, 347.9, 288.7, 295.0, 316.7,
    293.2, 305.4, 326.5, 354.4, 338.8, 365.8, 390.6, 381.5, 345.2, 290.6, 292.1, 317.6,
    294.0, 299.6, 316.3, 338.1, 328.9, 353.0, 373.0, 370.2, 343.6, 292.6, 300.1, 324.4,
    301.2, 309.8, 326.7, 345.7, 337.3, 337.8, 329.3, 315.4, 310.8, 310.6, 299.4, 323.8,
)
REAL_TOP_COVERAGE = (
    0.4392, 0.5385, 0.4609, 0.6091, 0.5930, 0.5390, 0.4981, 0.5205, 0.5751, 0.6407, 0.6429,
    0.6163, 0.6498, 0.6352, 0.6052, 0.5551, 0.5828, 0.5314, 0.5067, 0.5323, 0.5834, 0.6426,
    0.6533, 0.6155, 0.6516, 0.6459, 0.6182, 0.5806, 0.5998, 0.5565, 0.5318, 0.5442, 0.5838,
    0.6408, 0.6321, 0.6031, 0.6345, 0.6266, 0.5980, 0.5619, 0.5742, 0.5715, 0.5832, 0.6148,
    0.6069, 0.6092, 0.6298, 0.5876,
)
# fmt: on
# The same model's per-layer LRU at 128 slots, warm, over 4 prompt sets of 128 decode tokens
REAL_LRU_HIT_RATES = (0.7728, 0.8350, 0.8133, 0.8643)
REAL_LRU_SOURCE = "doramirdor/mbolt@e7e9dbf results/qwen80/gate_warm128.json (MIT)"


def effective_experts(counts: np.ndarray) -> np.ndarray:
    """exp(entropy) of selection counts (..., E) -> (...): E for uniform use, 1 for one expert."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    if (total <= 0).any():
        raise ValueError("counts: every row needs at least one selection")
    p = counts / total
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return np.exp(-plogp.sum(axis=-1))


def top_coverage(counts: np.ndarray, capacity: int) -> np.ndarray:
    """Share of selections (..., E) -> (...) that go to the `capacity` most selected experts."""
    counts = np.asarray(counts, dtype=np.float64)
    if not 1 <= capacity <= counts.shape[-1]:
        raise ValueError(f"capacity: must be in [1, E={counts.shape[-1]}], got {capacity}")
    total = counts.sum(axis=-1)
    if (total <= 0).any():
        raise ValueError("counts: every row needs at least one selection")
    top = -np.sort(-counts, axis=-1)[..., :capacity]
    return top.sum(axis=-1) / total


@dataclass(frozen=True)
class ShareCurve:
    """Rank-share curve s_r ∝ max(exp(sigma z_r) - exp(sigma tau), 0), z_r = Φ⁻¹(1 - (r + ½)/E)
    for ranks r = 0..E-1: the quantiles of a log-normal popularity, cut below at z = tau (the
    rarest experts are never selected). Written in rank quantiles, one curve serves every E."""

    sigma: float
    tau: float

    def shares(self, num_experts: int) -> np.ndarray:
        """(E,) float64 shares, hottest first, summing to 1."""
        z = norm.ppf(1.0 - (np.arange(num_experts) + 0.5) / num_experts)
        w = np.maximum(np.exp(self.sigma * z) - np.exp(self.sigma * self.tau), 0.0)
        if w.sum() <= 0:
            raise ValueError(f"{self}: no expert has a positive share at E={num_experts}")
        return w / w.sum()


def fit_share_curve(
    effective: float,
    coverage: float,
    num_experts: int = REAL_NUM_EXPERTS,
    capacity: int = REAL_CAPACITY,
) -> ShareCurve:
    """The `ShareCurve` with `effective` effective experts and `coverage` top-`capacity`
    coverage at E = `num_experts` (each within 0.5%); an error if no curve has both."""
    if not (1 <= effective <= num_experts and capacity / num_experts <= coverage <= 1):
        raise ValueError(
            f"no share curve over E={num_experts} has {effective} effective experts and top-"
            f"{capacity} coverage {coverage}"
        )

    def residuals(x: np.ndarray) -> list[float]:
        s = ShareCurve(float(x[0]), float(x[1])).shares(num_experts)
        return [
            math.log(effective_experts(s) / effective),
            math.log(top_coverage(s, capacity) / coverage),
        ]

    fit = least_squares(residuals, x0=[1.0, -3.0], bounds=([1e-3, -12.0], [8.0, 0.0]))
    if np.abs(fit.fun).max() > 5e-3:
        raise ValueError(
            f"no share curve over E={num_experts} has {effective} effective experts and top-"
            f"{capacity} coverage {coverage} (closest: {np.exp(fit.fun) - 1} relative error)"
        )
    return ShareCurve(float(fit.x[0]), float(fit.x[1]))


def real_band(layer: int, num_layers: int) -> range:
    """The real model's layers at the relative depth of `layer` of `num_layers`: the 48 split
    into `num_layers` equal bands (one layer each when there are more than 48)."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer: must be in [0, {num_layers}), got {layer}")
    n = len(REAL_EFFECTIVE_EXPERTS)
    lo = layer * n // num_layers
    return range(lo, max((layer + 1) * n // num_layers, lo + 1))


def real_figures(num_layers: int) -> np.ndarray:
    """(L, 2): per layer the mean effective experts and top-128 coverage of its real band."""
    eff, cov = np.asarray(REAL_EFFECTIVE_EXPERTS), np.asarray(REAL_TOP_COVERAGE)
    bands = [list(real_band(layer, num_layers)) for layer in range(num_layers)]
    return np.array([[eff[b].mean(), cov[b].mean()] for b in bands])


@functools.lru_cache(maxsize=16)
def _real_curves(num_layers: int) -> tuple[ShareCurve, ...]:
    return tuple(fit_share_curve(e, c) for e, c in real_figures(num_layers))


def target_shares(num_layers: int, num_experts: int) -> np.ndarray:
    """(L, E) float64: per layer the real model's rank-share curve (its band's figures, as a
    `ShareCurve`) at E experts, hottest first."""
    return np.stack([c.shares(num_experts) for c in _real_curves(num_layers)])
