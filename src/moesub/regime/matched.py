"""The regime under the real reference model's skew: static-skew measures beside the real
model's, on the evaluation trace and on its skew-matched twin (`moesub.skewmatch`).

A model can hit like the real reference model for another reason: the embedded model's hottest
quarter of experts covers ~0.8 of its selections where the real model's covers ~0.6
(`moesub.skew`), so its hits come more from static skew, which an initial set or a pin list
exploits, and less from temporal locality. The skew-matched world replaces both captures
(evaluation and calibration) by their skew-matched twins: the same streams with the expert ids
of each stream relabelled so that the pooled popularity per layer is the real model's; layouts
(initial sets, pins, planned allocations) come from the matched calibration exactly as the
pipeline's come from the calibration capture.

`skew_table` has, per layer (and ``layer = -1``: coverages and hit rates pooled over the layers,
effective experts the smallest layer's, as in `moesub.regime.measure`):

- ``top_coverage``: share of the evaluation selections that go to the layer's C hottest experts
  at the study's C (25% resident), ``top_coverage_<size>`` at each configured cache size;
- ``real_top_coverage`` / ``real_top_coverage_<size>`` and ``real_effective_experts``: the same
  for the real model's share curve at this model's E (`moesub.skew.target_shares`);
- ``matched_top_coverage``, ``matched_effective_experts``: what the skew-matched trace reached;
- ``stream_top_coverage``: the same coverage within each stream (its own C hottest), averaged
  over streams by selections: the concentration an adaptive cache meets, the same on both
  traces (the match keeps every stream's routing);
- ``initial_coverage`` / ``matched_initial_coverage``: the share of the evaluation selections
  on the initial set (the calibration ranking's first C at the regime's size): what a static
  set drawn from calibration serves out of sample, on each trace;
- ``matched_hit_rate``: `fetch_every_miss` at the regime's C on the skew-matched trace, caches
  starting from the matched calibration's ranking.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from moesub.skew import (
    REAL_LRU_HIT_RATES,
    REAL_LRU_SOURCE,
    REAL_MODEL,
    REAL_SOURCE,
    effective_experts,
    top_coverage,
)
from moesub.vocabulary import capacity_for

STUDY_FRACTION = 0.25  # the reference study's cache: 128 of the real model's 512 experts
SKEW_COLUMNS = (
    "top_coverage",
    "real_top_coverage",
    "matched_top_coverage",
    "real_effective_experts",
    "matched_effective_experts",
    "stream_top_coverage",
    "initial_coverage",
    "matched_initial_coverage",
    "matched_hit_rate",
)


def initial_coverage(counts: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """(L, E) selection counts and (L, C) initial sets -> (L,) share of selections on the set."""
    on_set = np.take_along_axis(counts, np.asarray(initial, np.int64), axis=1).sum(axis=1)
    return on_set / counts.sum(axis=1)


def skew_table(
    counts: np.ndarray,
    matched_counts: np.ndarray,
    stream_counts: np.ndarray,
    shares: np.ndarray,
    initial: np.ndarray,
    matched_initial: np.ndarray,
    matched_hit_rate: np.ndarray,
    sizes: Mapping[str, int],
) -> pl.DataFrame:
    """The skew columns per layer + layer -1 (module docs).

    `counts` / `matched_counts`: (L, E) selection counts of the evaluation trace and of its
    skew-matched twin; `stream_counts`: (S, L, E) per stream; `shares`: (L, E) the real
    model's share curve (hottest first);
    `initial` / `matched_initial`: (L, C) the initial sets of each world at the regime's size;
    `matched_hit_rate`: (L + 1,) per layer then pooled; `sizes`: cache size label -> C.
    """
    L, E = counts.shape
    study = capacity_for(STUDY_FRACTION, E)
    per_layer: dict[str, np.ndarray] = {
        "top_coverage": top_coverage(counts, study),
        "real_top_coverage": top_coverage(shares, study),
        "matched_top_coverage": top_coverage(matched_counts, study),
        "real_effective_experts": effective_experts(shares),
        "matched_effective_experts": effective_experts(matched_counts),
        "stream_top_coverage": np.average(
            top_coverage(stream_counts, study), axis=0, weights=stream_counts.sum(axis=2)
        ),  # (S, L) -> (L,)
        "initial_coverage": initial_coverage(counts, initial),
        "matched_initial_coverage": initial_coverage(matched_counts, matched_initial),
        "matched_hit_rate": np.asarray(matched_hit_rate[:L], np.float64),
    }
    for label, capacity in sizes.items():
        per_layer[f"top_coverage_{label}"] = top_coverage(counts, capacity)
        per_layer[f"real_top_coverage_{label}"] = top_coverage(shares, capacity)
    rows = [
        {"layer": layer, **{c: float(v[layer]) for c, v in per_layer.items()}} for layer in range(L)
    ]
    # all layers: every layer has the same number of selections, so pooled shares are means
    total = {c: float(v.min() if "effective" in c else v.mean()) for c, v in per_layer.items()}
    total["matched_hit_rate"] = float(matched_hit_rate[L])
    return pl.DataFrame([*rows, {"layer": -1, **total}])


def _span(values: pl.Series, fmt: str) -> str:
    lo, hi = values.min(), values.max()
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}-{hi:{fmt}}"


def skew_verdict(table: pl.DataFrame, hit_rate: float, capacity: int, num_experts: int) -> str:
    """One line: how skewed the model routes beside the real model, and what a static set
    drawn from calibration and fetch_every_miss get under each skew."""
    layers = table.filter(pl.col("layer") >= 0)
    total = table.filter(pl.col("layer") == -1).row(0, named=True)
    study = capacity_for(STUDY_FRACTION, num_experts)
    return (
        f"static skew: a layer's {study} hottest experts cover "
        f"{_span(layers['top_coverage'], '.2f')} of its selections (the real {REAL_MODEL} at "
        f"this E: {_span(layers['real_top_coverage'], '.2f')}); the calibration's first "
        f"{capacity} cover {total['initial_coverage']:.3f} of the evaluation selections, "
        f"{total['matched_initial_coverage']:.3f} under the real model's skew, where "
        f"fetch_every_miss hits {total['matched_hit_rate']:.3f} (vs {hit_rate:.3f}; the real "
        f"model's public LRU replays at 25%: {min(REAL_LRU_HIT_RATES):.2f}-"
        f"{max(REAL_LRU_HIT_RATES):.2f})"
    )


def skew_summary(table: pl.DataFrame, hit_rate: float, capacity: int, E: int) -> dict[str, Any]:
    """The regime summary's `skew` entry: the verdict line, the headline figures, sources."""
    total = table.filter(pl.col("layer") == -1).row(0, named=True)
    return {
        "verdict": skew_verdict(table, hit_rate, capacity, E),
        "study_capacity": capacity_for(STUDY_FRACTION, E),
        **{c: total[c] for c in SKEW_COLUMNS},
        "real_model": REAL_MODEL,
        "real_source": REAL_SOURCE,
        "real_lru_hit_rates": list(REAL_LRU_HIT_RATES),
        "real_lru_source": REAL_LRU_SOURCE,
    }
