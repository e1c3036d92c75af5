"""What a design can detect: the smallest reachable p-value and the minimum detectable effect.

Shown next to every test, so that "no detectable effect" is read against what the design could
have found. Every MDE is a normal-approximation sensitivity figure, not a test result:

- `wilcoxon_min_p(n)`: the exact signed-rank test over n non-zero paired differences cannot go
  below `2**-n` one-sided (all signs agree), `2**(1 - n)` two-sided: with 4 streams, 1/16;
- `paired_mde(sd, n, alpha)`: the smallest true mean of paired differences that a one-sided
  level-alpha test over n pairs detects with probability `power`, by the normal approximation
  `(z_{1-alpha} + z_{power}) * sd / sqrt(n)` (sd: the per-pair standard deviation);
- `normal_mde(se, alpha)`: the same for any estimate with standard error `se` (e.g. the
  jackknife SE of a bootstrapped statistic), two-sided: `(z_{1-alpha/2} + z_{power}) * se`;
- `proportion_mde(p0, n, alpha)`: the smallest drop from a baseline proportion p0 (accuracy over
  n problems) that a two-sided level-alpha test of p = p0 detects with probability `power`
  (normal approximation, variance under the null and under the alternative).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

ALTERNATIVES = ("greater", "less", "two-sided")


def _check_alternative(alternative: str) -> None:
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r} is not one of {ALTERNATIVES}")


def _check(alpha: float, power: float, alternative: str) -> None:
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha={alpha} and power={power} must be in (0, 1)")
    _check_alternative(alternative)


def wilcoxon_min_p(n: int, alternative: str = "greater") -> float:
    """Smallest exact p-value of a Wilcoxon signed-rank test over n non-zero differences."""
    _check_alternative(alternative)
    if n < 1:
        return 1.0
    return min(1.0, 0.5 ** (n - 1 if alternative == "two-sided" else n))


def _z_alpha(alpha: float, alternative: str) -> float:
    return float(sps.norm.ppf(1 - (alpha / 2 if alternative == "two-sided" else alpha)))


def paired_mde(
    sd: float, n: int, alpha: float, power: float = 0.8, alternative: str = "greater"
) -> float | None:
    """Minimum detectable mean paired difference (module doc); None when n < 2 or sd unknown."""
    _check(alpha, power, alternative)
    if n < 2 or sd is None or not np.isfinite(sd):
        return None
    return (_z_alpha(alpha, alternative) + float(sps.norm.ppf(power))) * float(sd) / math.sqrt(n)


def normal_mde(se: float | None, alpha: float, power: float = 0.8) -> float | None:
    """Minimum detectable effect of a two-sided level-alpha test of an estimate with standard
    error `se` (module doc); None when se is unknown."""
    _check(alpha, power, "two-sided")
    if se is None or not np.isfinite(se):
        return None
    return (_z_alpha(alpha, "two-sided") + float(sps.norm.ppf(power))) * float(se)


def proportion_mde(
    p0: float, n: int, alpha: float, power: float = 0.8, alternative: str = "two-sided"
) -> float | None:
    """Minimum detectable drop below a baseline proportion `p0` over `n` problems (module doc).

    None when no drop is detectable (p0 too small for n: even p = 0 is not far enough).
    """
    _check(alpha, power, alternative)
    if n < 1 or not 0 <= p0 <= 1:
        return None
    za, zb = _z_alpha(alpha, alternative), float(sps.norm.ppf(power))

    def short(delta: float) -> float:  # > 0 while a drop of delta is not yet detectable
        p1 = p0 - delta
        return za * math.sqrt(p0 * (1 - p0) / n) + zb * math.sqrt(p1 * (1 - p1) / n) - delta

    if p0 == 0 or short(p0) > 0:
        return None
    lo, hi = 0.0, p0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if short(mid) > 0 else (lo, mid)
    return hi
