"""Which selected experts each Experiment B condition substitutes, from one row's gate weights.

Input everywhere: gate weights `(N, k)` float64 in rank order (rank 1 first, as the policy core
returns them: non-increasing along a row). The first choice (rank 1) is never substituted.

Design `study` (the reference study's rules, kept as they were; composition and mass differ):
- heavy: the single rank >= 2 with the largest weight <= m* (ties: the better rank);
- light: the longest run of the lowest weights (ascending; ties: the worse rank first) whose sum
  is <= m*, only if it has at least 2 experts.

Design `matched` (`matched_masks`): at one token-layer,
- heavy: one tail expert (rank >= 2) whose weight w_H is within +-10% of `heavy_mass`;
- light: at least 3 *other* tail experts, each <= w_H / 2, whose weights sum to within 5% of w_H.
A row is eligible only when both exist (common support); it is then marked in both masks.
Deterministic choice among several valid (heavy, light) pairs, in this order:
1. heavy: the candidate closest to `heavy_mass` (ties: the better rank) among those that have a
   valid light set;
2. light: the set whose sum is closest to w_H (the two conditions' masses match best; relative
   gaps compared to 9 decimals, so that sets differing only by rounding tie); ties go to the set
   with the smallest bit mask, bit i = rank i + 2 (i.e. the set whose worst rank is best).
"""

from __future__ import annotations

import numpy as np

STUDY_CONDITIONS = ("heavy", "light")
HEAVY_TOLERANCE = 0.10  # |w_H - heavy_mass| <= this * heavy_mass
LIGHT_MAX_RATIO = 0.5  # every light weight <= this * w_H
LIGHT_SUM_TOLERANCE = 0.05  # |sum(light) - w_H| <= this * w_H
MIN_LIGHT = 3  # light experts per token-layer
MAX_TAIL = 16  # matched_masks enumerates the 2^(k-1) subsets of the tail


def _check_weights(weights: np.ndarray, mass: float, name: str = "target_mass") -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] < 1:
        raise ValueError(f"weights must be (N, k) with k >= 1, got shape {w.shape}")
    if isinstance(mass, bool) or not np.isfinite(mass) or mass < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {mass!r}")
    return w


# --------------------------------------------------------------------------- design: study
def select_heavy(weights: np.ndarray, target_mass: float) -> np.ndarray:
    """(N, k) bool: the single rank >= 2 with the largest weight <= m* (ties: better rank)."""
    w = _check_weights(weights, target_mass)
    n, k = w.shape
    mask = np.zeros((n, k), dtype=bool)
    if k < 2:
        return mask
    tail = w[:, 1:]  # ranks 2..k
    eligible = tail <= target_mass
    score = np.where(eligible, tail, -np.inf)
    best = np.argmax(score, axis=1)  # first maximum = better rank among ties
    rows = np.flatnonzero(eligible.any(axis=1))
    mask[rows, best[rows] + 1] = True
    return mask


def select_light(weights: np.ndarray, target_mass: float) -> np.ndarray:
    """(N, k) bool: the longest ascending-weight run of ranks >= 2 whose sum is <= m*, if >= 2
    experts long (ties in weight: the worse rank joins the run first)."""
    w = _check_weights(weights, target_mass)
    n, k = w.shape
    mask = np.zeros((n, k), dtype=bool)
    if k < 3:
        return mask
    tail = w[:, 1:]  # (N, k-1) ranks 2..k
    # ascending weight; among equal weights the worse (higher) rank first
    worse_first = np.broadcast_to(-np.arange(tail.shape[1]), tail.shape)
    order = np.lexsort((worse_first, tail), axis=1)  # primary key: weight; then worse rank
    sorted_w = np.take_along_axis(tail, order, axis=1)
    run = (np.cumsum(sorted_w, axis=1) <= target_mass).sum(axis=1)  # prefix sums are monotone
    take = (np.arange(tail.shape[1])[None, :] < run[:, None]) & (run[:, None] >= 2)
    sub_tail = np.zeros_like(take)
    np.put_along_axis(sub_tail, order, take, axis=1)
    mask[:, 1:] = sub_tail
    return mask


def select_substitutions(weights: np.ndarray, condition: str, target_mass: float) -> np.ndarray:
    """The study design's substitution mask (N, k) for `condition` in {"heavy", "light"}."""
    if condition == "heavy":
        return select_heavy(weights, target_mass)
    if condition == "light":
        return select_light(weights, target_mass)
    raise ValueError(f"condition must be one of {STUDY_CONDITIONS}, got {condition!r}")


# --------------------------------------------------------------------------- design: matched
def _tail_subsets(tail: int) -> np.ndarray:
    """(S, tail) bool: every subset of the tail with >= MIN_LIGHT members, by bit mask value."""
    bits = (np.arange(2**tail)[:, None] >> np.arange(tail)[None, :]) & 1  # (2^tail, tail)
    return bits[bits.sum(axis=1) >= MIN_LIGHT].astype(bool)


def matched_masks(
    weights: np.ndarray, heavy_mass: float, chunk_rows: int = 2048
) -> tuple[np.ndarray, np.ndarray]:
    """(heavy, light) bool masks (N, k) of the matched design at every eligible row.

    `weights`: gate weights (N, k) float64 in rank order (non-increasing along each row).
    A row is marked in both masks or in neither: heavy marks exactly one rank >= 2 whose weight
    w_H is within +-10% of `heavy_mass`; light marks >= 3 other ranks >= 2, each <= w_H / 2,
    summing to within 5% of w_H. Every row where such a pair exists is marked (before any
    subsampling); the choice among several pairs is the module docstring's.
    """
    w = _check_weights(weights, heavy_mass, "heavy_mass")
    if heavy_mass <= 0:
        raise ValueError(f"heavy_mass must be > 0, got {heavy_mass!r}")
    if np.isnan(w).any() or (np.diff(w, axis=1) > 0).any():
        raise ValueError("weights must be finite and in rank order (non-increasing along a row)")
    n, k = w.shape
    heavy = np.zeros((n, k), dtype=bool)
    light = np.zeros((n, k), dtype=bool)
    tail = k - 1
    if tail < 1 + MIN_LIGHT:
        return heavy, light
    if tail > MAX_TAIL:
        raise ValueError(f"matched_masks enumerates 2^(k-1) light sets: k = {k} > {MAX_TAIL + 1}")
    subsets = _tail_subsets(tail)  # (S, tail)
    best_rank = subsets.argmax(axis=1)  # its largest weight: weights fall along the rank
    heavy_ok = np.abs(w[:, 1:] - heavy_mass) <= HEAVY_TOLERANCE * heavy_mass  # (N, tail)
    rows = np.flatnonzero(heavy_ok.any(axis=1))  # rows without a heavy candidate are not eligible
    for start in range(0, rows.size, chunk_rows):
        r = rows[start : start + chunk_rows]
        t = w[r, 1:]  # (n, tail)
        sums = t @ subsets.T.astype(np.float64)  # (n, S)
        top = t[:, best_rank]  # (n, S)
        gap = np.full((r.size, tail), np.inf)  # best light gap per heavy candidate
        pick = np.zeros((r.size, tail), dtype=np.int64)  # that light set (index into subsets)
        for h in range(tail):
            w_h = t[:, h : h + 1]  # (n, 1)
            valid = (
                heavy_ok[r, h : h + 1]
                & ~subsets[None, :, h]
                & (top <= LIGHT_MAX_RATIO * w_h)
                & (np.abs(sums - w_h) <= LIGHT_SUM_TOLERANCE * w_h)
            )  # (n, S)
            # relative gap to 9 decimals: sets equal up to rounding (zero weights) are ties
            with np.errstate(divide="ignore", invalid="ignore"):  # w_h = 0 is never valid
                g = np.where(valid, np.round(np.abs(sums - w_h) / w_h, 9), np.inf)
            pick[:, h] = np.argmin(g, axis=1)  # first minimum = smallest bit mask
            gap[:, h] = g[np.arange(r.size), pick[:, h]]
        has = np.isfinite(gap)  # (n, tail)
        dist = np.where(has, np.abs(t - heavy_mass), np.inf)
        h_star = np.argmin(dist, axis=1)  # first minimum = better rank
        ok = has[np.arange(r.size), h_star]
        rr, hh = r[ok], h_star[ok]
        heavy[rr, hh + 1] = True
        light[rr, 1:] = subsets[pick[ok, hh]]
    return heavy, light
