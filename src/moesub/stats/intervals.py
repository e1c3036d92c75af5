"""Interval and resampling helpers: the stream bootstrap (BCa), correlation, Wilson, median CI.

All bootstraps resample streams, the unit of independence: `boot_indices` draws the streams of
each resample, `counts_of` turns them into weights, and a statistic of per-stream sums is a
matrix product of weights `(R, S)` with sums `(S, ...)`. `stream_bootstrap` evaluates one such
statistic on the full sample (weights 1), on every resample and on every leave-one-stream-out
jackknife sample, and returns a bias-corrected interval:

- BCa (bias-corrected and accelerated, Efron 1987): the percentile interval at levels shifted
  by the bias correction `z0` (the share of resamples below the estimate, ties counted half,
  a tie being equality up to a relative 1e-9)
  and the acceleration `a` (the jackknife skewness);
- basic (`2 * estimate - quantiles`) where BCa is undefined: every resample on one side of the
  estimate (z0 infinite), or a non-finite jackknife value;
- none where fewer than half of the resamples give a finite value.

Every interval reports the bootstrap bias `mean(resamples) - estimate` beside it: with few
streams the resampling distribution sits off the estimate, and the bias says by how much.

Beside each interval, as a sensitivity figure for few streams (24 by default), a t-based
interval `estimate -/+ t_{S-1} * SE`, SE the leave-one-stream-out jackknife standard error.
Asked for a null value (`null=`), the bootstrap also gives the two-sided p-value of "the
statistic equals `null`" that its own interval inverts: the largest level at which the BCa
(basic) interval still holds `null`, so the interval excludes `null` exactly when p < 1 - level
(up to the resamples' quantile interpolation). It cannot go below `1 / n_valid`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps


def rng_for(seed: int, *keys: Any) -> np.random.Generator:
    """A generator seeded by `seed` and the keys (part, policy, ...): one stream per statistic."""
    return np.random.default_rng([seed, *(zlib.crc32(str(k).encode()) for k in keys)])


def z_of(level: float) -> float:
    """The two-sided normal quantile of a confidence level (0.95 -> 1.96)."""
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    return float(sps.norm.ppf(0.5 + level / 2))


def level_label(level: float) -> str:
    """'95%' for 0.95: every CI label derives from ci_level."""
    return f"{100 * level:g}%"


def boot_indices(n_units: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n_units) int: the units drawn (with replacement) in each resample."""
    if n_units < 1 or n_boot < 1:
        raise ValueError(f"n_units={n_units} and n_boot={n_boot} must be >= 1")
    return rng.integers(0, n_units, size=(n_boot, n_units))


def counts_of(indices: np.ndarray, n_units: int) -> np.ndarray:
    """(R, n_units) float64: how often each unit is drawn in each resample of `indices` (R, m)."""
    rows = np.repeat(np.arange(indices.shape[0]), indices.shape[1])
    out = np.zeros((indices.shape[0], n_units))
    np.add.at(out, (rows, indices.ravel()), 1.0)
    return out


def boot_counts(n_units: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n_units) float64: how often each unit is drawn in each resample."""
    return counts_of(boot_indices(n_units, n_boot, rng), n_units)


def jackknife_weights(n_units: int) -> np.ndarray:
    """(n_units, n_units) float64: row i leaves unit i out."""
    return 1.0 - np.eye(n_units)


@dataclass(frozen=True)
class Interval:
    """A bootstrapped estimate: its CI, the bootstrap bias and how the CI was made."""

    estimate: float | None
    ci_lo: float | None = None
    ci_hi: float | None = None
    bias: float | None = None  # mean of the finite resamples minus the estimate
    method: str = "none"  # bca | basic | none
    n_valid: int = 0  # resamples with a finite value
    t_lo: float | None = None  # sensitivity: estimate -/+ t_{S-1} * jackknife SE
    t_hi: float | None = None
    se: float | None = None  # the jackknife standard error
    p_value: float | None = None  # two-sided, of "the statistic equals null" (when asked)

    def columns(self, prefix: str = "") -> dict[str, Any]:
        """`{prefix}ci_lo, {prefix}ci_hi, {prefix}bias, {prefix}ci_method` and the t-based
        sensitivity interval `{prefix}t_ci_lo, {prefix}t_ci_hi` for a table row."""
        return {
            f"{prefix}ci_lo": self.ci_lo,
            f"{prefix}ci_hi": self.ci_hi,
            f"{prefix}bias": self.bias,
            f"{prefix}ci_method": self.method,
            f"{prefix}t_ci_lo": self.t_lo,
            f"{prefix}t_ci_hi": self.t_hi,
        }


def t_interval(
    estimate: float, jack: np.ndarray, level: float
) -> tuple[float | None, float | None, float | None]:
    """(lo, hi, se): `estimate -/+ t_{n-1} * se`, se the jackknife standard error of the
    leave-one-out values `jack` (n,); Nones when n < 2 or a value is not finite."""
    j = np.asarray(jack, dtype=float)
    if j.size < 2 or not np.isfinite(j).all() or not math.isfinite(estimate):
        return None, None, None
    se = math.sqrt((j.size - 1) / j.size * float(((j - j.mean()) ** 2).sum()))
    half = float(sps.t.ppf(0.5 + level / 2, j.size - 1)) * se
    return estimate - half, estimate + half, se


def _two_sided(z: float) -> float:
    return 2.0 * min(float(sps.norm.cdf(z)), float(sps.norm.sf(z)))


def _share_below(ok: np.ndarray, value: float) -> float:
    """Share of `ok` below `value`, ties (equal up to rounding) counted half."""
    tie = np.abs(ok - value) <= 1e-9 * max(abs(value), float(np.abs(ok).max()), 1e-300)
    return float(((ok < value) & ~tie).sum() + 0.5 * tie.sum()) / ok.size


def bootstrap_interval(
    estimate: float, boot: np.ndarray, jack: np.ndarray, level: float, null: float | None = None
) -> Interval:
    """BCa interval of `estimate` from its resamples `boot` (B,) and jackknife values `jack` (S,),
    basic where BCa is undefined (module doc); no interval when under half of `boot` is finite
    or the estimate is not finite. With `null`, the p-value that inverts the interval."""
    b = np.asarray(boot, dtype=float)
    ok = b[np.isfinite(b)]
    if not math.isfinite(estimate):
        return Interval(None, n_valid=int(ok.size))
    t_lo, t_hi, se = t_interval(float(estimate), jack, level)
    sensitivity = {"t_lo": t_lo, "t_hi": t_hi, "se": se}
    if ok.size == 0 or ok.size < 0.5 * b.size:
        return Interval(float(estimate), n_valid=int(ok.size), **sensitivity)
    bias = float(ok.mean() - estimate)
    alpha = (1 - level) / 2
    # resamples equal to the estimate (e.g. every stream drawn once) count half; "equal" up to
    # rounding, which differs with the summation order
    share_below = _share_below(ok, estimate)
    j = np.asarray(jack, dtype=float)
    if 0 < share_below < 1 and j.size >= 2 and np.isfinite(j).all():
        z0 = float(sps.norm.ppf(share_below))
        d = j.mean() - j
        den = float((d * d).sum()) ** 1.5
        accel = float((d**3).sum()) / (6.0 * den) if den > 0 else 0.0
        levels = []
        for z in (sps.norm.ppf(alpha), sps.norm.ppf(1 - alpha)):
            shift = 1.0 - accel * (z0 + z)
            levels.append(sps.norm.cdf(z0 + (z0 + z) / shift) if shift > 0 else math.nan)
        if all(math.isfinite(x) for x in levels):
            lo, hi = np.quantile(ok, levels)
            p = None if null is None else _bca_p(ok, null, z0, accel)
            iv = (float(estimate), float(lo), float(hi), bias, "bca", int(ok.size))
            return Interval(*iv, **sensitivity, p_value=p)
    q_lo, q_hi = np.quantile(ok, [alpha, 1 - alpha])
    lo, hi = 2 * estimate - q_hi, 2 * estimate - q_lo
    # the basic interval holds null while 2 * estimate - null lies between the quantiles
    p = None if null is None else _percentile_p(ok, 2 * estimate - null)
    iv = (float(estimate), float(lo), float(hi), bias, "basic", int(ok.size))
    return Interval(*iv, **sensitivity, p_value=p)


def _clipped_share(ok: np.ndarray, value: float) -> float:
    """`_share_below`, kept half a resample inside (0, 1): no resample beyond `value` is a
    p-value of about 1 / B, not 0."""
    half = 0.5 / ok.size
    return min(max(_share_below(ok, value), half), 1.0 - half)


def _percentile_p(ok: np.ndarray, value: float) -> float:
    """Two-sided p at which a percentile interval of `ok` has `value` as a bound."""
    q = _clipped_share(ok, value)
    return max(2.0 * min(q, 1.0 - q), 1.0 / ok.size)


def _bca_p(ok: np.ndarray, null: float, z0: float, accel: float) -> float:
    """Two-sided p at which the BCa interval has `null` as a bound: `null` sits at the
    resamples' quantile q; BCa puts level z there when z0 + w / (1 - a w) = Phi^-1(q) with
    w = z0 + z, so w = u / (1 + a u), u = Phi^-1(q) - z0, and p = 2 min(Phi(z), 1 - Phi(z))."""
    u = float(sps.norm.ppf(_clipped_share(ok, null))) - z0
    if 1.0 + accel * u <= 0:  # beyond every level the BCa map reaches: the floor
        return 1.0 / ok.size
    return max(_two_sided(u / (1.0 + accel * u) - z0), 1.0 / ok.size)


def stream_bootstrap(
    stat: Callable[[np.ndarray], np.ndarray],
    n_units: int,
    n_boot: int,
    rng: np.random.Generator,
    level: float,
    null: float | None = None,
) -> list[Interval]:
    """Bias-corrected intervals of a statistic of stream weights, one per output column.

    `stat(w)`: weights `(R, n_units)` -> `(R,)` or `(R, P)` values (NaN where undefined). The
    estimate is `stat` at weights 1; the resamples are `n_boot` stream resamples from `rng`;
    the jackknife leaves out one stream at a time. Returns P intervals (1 for a `(R,)` stat),
    each with the p-value of "the statistic equals `null`" when `null` is given.
    """
    est = np.atleast_1d(np.asarray(stat(np.ones((1, n_units))), dtype=float)[0])
    boot = np.asarray(stat(boot_counts(n_units, n_boot, rng)), dtype=float).reshape(n_boot, -1)
    jack = np.asarray(stat(jackknife_weights(n_units)), dtype=float).reshape(n_units, -1)
    return [
        bootstrap_interval(float(est[p]), boot[:, p], jack[:, p], level, null)
        for p in range(est.size)
    ]


def rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair: x, y (B, P) -> (B,), NaN where a row is constant."""
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xc * yc).sum(axis=1) / den
    scale = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1)) + 1e-300
    return np.where(den > 1e-12 * scale, np.clip(r, -1.0, 1.0), np.nan)


def weighted_pearson(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pearson r of the points (x, y) (N,) counted with weights w (R, N) (a resample's counts):
    (R,), NaN where a coordinate is constant under the weights."""
    sw = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx, my = (w @ x) / sw, (w @ y) / sw
        vx = (w @ (x * x)) / sw - mx * mx
        vy = (w @ (y * y)) / sw - my * my
        cov = (w @ (x * y)) / sw - mx * my
        r = cov / np.sqrt(vx * vy)
    tiny = 1e-12 * (np.abs(x).max() ** 2 + 1e-300), 1e-12 * (np.abs(y).max() ** 2 + 1e-300)
    return np.where((vx > tiny[0]) & (vy > tiny[1]), np.clip(r, -1.0, 1.0), np.nan)


def correlation(
    x: Sequence[float], y: Sequence[float], level: float = 0.95, parametric: bool = True
) -> dict[str, Any]:
    """Pearson r and Spearman rho, or why they are undefined.

    With `parametric` (independent units, e.g. streams or problems): Pearson's and Spearman's
    p-values and, when n >= 4, the Fisher-z CI at `level`. Without (points that are not
    independent samples, e.g. policies that are nested sweeps of one another): r and rho only;
    their uncertainty comes from a stream bootstrap instead.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = int(x.size)
    out: dict[str, Any] = {"n": n, "r": None, "rho": None, "reason": None}
    if parametric:
        out.update({"p": None, "r_ci_lo": None, "r_ci_hi": None, "rho_p": None})
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
    rho, rho_p = sps.spearmanr(x, y)
    out["r"], out["rho"] = float(r), float(rho)
    if not parametric:
        return out
    out["p"], out["rho_p"] = float(p), float(rho_p)
    if n >= 4 and abs(r) < 1:
        z, half = math.atanh(r), z_of(level) / math.sqrt(n - 3)
        out["r_ci_lo"], out["r_ci_hi"] = math.tanh(z - half), math.tanh(z + half)
    elif abs(r) >= 1:
        out["r_ci_lo"] = out["r_ci_hi"] = float(r)
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
