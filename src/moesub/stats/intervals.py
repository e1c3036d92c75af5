"""Interval and resampling helpers: the stream bootstrap, correlation, Wilson, median CI.

All bootstraps resample streams (the unit of independence): `boot_counts` gives how often each
stream is drawn in each resample, and a statistic of per-stream sums is a matrix product.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats as sps


def rng_for(seed: int, *keys: Any) -> np.random.Generator:
    return np.random.default_rng([seed, *(zlib.crc32(str(k).encode()) for k in keys)])


def boot_counts(n_units: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n_units) float64: how often each unit is drawn in each resample."""
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_boot).astype(float)


def rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair: x, y (B, P) -> (B,), NaN where a row is constant."""
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xc * yc).sum(axis=1) / den
    scale = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1)) + 1e-300
    return np.where(den > 1e-12 * scale, np.clip(r, -1.0, 1.0), np.nan)


def percentile_ci(samples: np.ndarray, level: float) -> tuple[float | None, float | None]:
    """Percentile interval of the finite samples (None when fewer than half are finite)."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if s.size == 0 or s.size < 0.5 * np.asarray(samples).size:
        return None, None
    lo, hi = np.quantile(s, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def correlation(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Pearson r (Fisher-z CI when n >= 4) and Spearman rho, or why they are undefined."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = int(x.size)
    out: dict[str, Any] = {"n": n, "r": None, "p": None, "r_ci_lo": None, "r_ci_hi": None}
    out.update({"rho": None, "rho_p": None, "reason": None})
    if n < 3:
        out["reason"] = f"undefined: n = {n} < 3"
        return out
    if np.ptp(x) <= 1e-12 * (np.abs(x).max() + 1e-300) or np.ptp(y) <= 1e-12 * (
        np.abs(y).max() + 1e-300
    ):
        out["reason"] = (
            "undefined: " + ("mass" if np.ptp(x) == 0 else "the outcome") + " is constant"
        )
        return out
    r, p = sps.pearsonr(x, y)
    out["r"], out["p"] = float(r), float(p)
    if n >= 4 and abs(r) < 1:
        z, half = math.atanh(r), 1.959963984540054 / math.sqrt(n - 3)
        out["r_ci_lo"], out["r_ci_hi"] = math.tanh(z - half), math.tanh(z + half)
    elif abs(r) >= 1:
        out["r_ci_lo"] = out["r_ci_hi"] = float(r)
    rho, rho_p = sps.spearmanr(x, y)
    out["rho"], out["rho_p"] = float(rho), float(rho_p)
    return out


def wilson_ci(successes: int, n: int, level: float = 0.95) -> tuple[float | None, float | None]:
    """Wilson score interval for a binomial proportion."""
    if n <= 0:
        return None, None
    z = float(sps.norm.ppf(1 - (1 - level) / 2))
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def median_ci(values: np.ndarray, level: float = 0.95) -> tuple[float | None, float | None]:
    """Distribution-free CI of the median from binomial order statistics."""
    v = np.sort(np.asarray(values, dtype=float))
    n = v.size
    if n == 0:
        return None, None
    lo = int(sps.binom.ppf((1 - level) / 2, n, 0.5))
    hi = int(sps.binom.isf((1 - level) / 2, n, 0.5))
    return float(v[max(lo - 1, 0)]), float(v[min(hi, n - 1)])
