"""Δppl and speedup: the one place in the project where they are computed.

Δppl % of a policy is `100 * (exp(mean(nll_p - nll_base)) - 1)` over the tokens both have an
NLL for. A speedup is a ratio of times per token on the same device and fraction:
`time(reference) / time(policy)`. The analysis (`moesub.stats`), `moesub.emulate.summarize`,
the engine's summary and its benchmark all call these; `speedup_text` says a speedup in words.
"""

from __future__ import annotations

import numpy as np


def dppl_pct(mean_dnll: np.ndarray | float) -> np.ndarray | float:
    """Δppl % from the mean per-token ΔNLL: 100 * (exp(mean ΔNLL) - 1)."""
    return 100.0 * np.expm1(mean_dnll)


def speedup(reference_s: np.ndarray | float, time_s: np.ndarray | float) -> np.ndarray | float:
    """How many times faster than the reference: `reference_s / time_s` (NaN where time <= 0
    or either is missing)."""
    ref = np.asarray(reference_s, dtype=float)
    t = np.asarray(time_s, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(t > 0, ref / t, np.nan)
    return out if out.ndim else float(out)


def speedup_text(x: float, reference: str) -> str:
    """A speedup in words: '2.50× faster than <reference>', or '1.04× slower than ...' for
    x < 1 (1/x times slower: never '0.96× faster'), 'as fast as ...' at 1.00."""
    if round(x, 2) == 1.0:
        return f"as fast as {reference}"
    if x > 1:
        return f"{x:.2f}× faster than {reference}"
    return f"{1 / x:.2f}× slower than {reference}"
