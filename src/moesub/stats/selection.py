"""The recommendation's split: candidates screened on one half of the evaluation streams, the
chosen policy's Δppl reported on the other half (issue 25 item 6).

A recommendation picks, among many policies, the fastest whose Δppl upper bound is within a
budget. The interval of the policy it picked, computed on the streams it was picked on, is
biased toward passing (among many candidates, the one whose streams happened to be kind is
the one chosen). So the evaluation streams are split once, seeded (`split_streams`: a
permutation drawn by `rng_for(seed, "selection_split")`; its first ceil(S / 2) streams are the
`screen` half, the rest the `report` half), and per (policy, fraction) the Δppl % is computed
on each half alone with its stream-bootstrap interval (the quality part's statistic, streams
of that half resampled). `moesub.recommend` screens on `screen` and reports `report`, the
streams it was not chosen on; the all-streams figure stays the quality table's. The calibration
streams cannot serve as the screen: nothing is emulated on them.

Entry point: `selection(per_stream, p) -> Selection` (`per_stream`: `Quality.streams`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from moesub.metrics import dppl_pct
from moesub.stats.intervals import rng_for, stream_bootstrap
from moesub.stats.load import missing
from moesub.stats.params import AnalysisParams
from moesub.stats.quality import ratio_stat

HALVES = ("screen", "report")
SPLIT_KEY = "selection_split"  # the key of the split's generator: rng_for(seed, SPLIT_KEY)


class Selection(NamedTuple):
    """`table`: per (policy, fraction, half) Δppl % with its interval on that half's streams;
    `result`: the split (`analysis.json["selection"]`: seed, the streams of each half, how
    they were drawn), None when missing; `status`."""

    table: pd.DataFrame
    result: dict[str, Any] | None
    status: dict[str, Any]


def split_streams(streams: np.ndarray, seed: int) -> dict[str, list[int]]:
    """The evaluation streams split in two (module doc): {"screen": ids, "report": ids}, each
    sorted; `screen` gets the odd stream out. Needs at least 2 streams."""
    ids = np.unique(np.asarray(streams, dtype=np.int64))
    if ids.size < 2:
        raise ValueError(f"split_streams: {ids.size} stream(s); a split needs at least 2")
    order = rng_for(seed, SPLIT_KEY).permutation(ids)
    cut = (ids.size + 1) // 2
    return {"screen": sorted(order[:cut].tolist()), "report": sorted(order[cut:].tolist())}


def selection(per_stream: pd.DataFrame, p: AnalysisParams) -> Selection:
    """Δppl % per (policy, fraction) on each half of the split (module doc), from the
    per-stream sums of the quality part (`Quality.streams`: name, fraction, stream, sum_dnll,
    n_nll)."""
    if per_stream.empty or not (per_stream["n_nll"] > 0).any():
        return Selection(pd.DataFrame(), None, missing("needs emulate artefacts and a baseline"))
    streams = per_stream["stream"].unique()
    if len(streams) < 2:
        why = f"{len(streams)} evaluation stream: no split into a screen and a report half"
        return Selection(pd.DataFrame(), None, missing(why))
    halves = split_streams(streams, p.seed)
    rows = []
    for (name, frac), g in per_stream.groupby(["name", "fraction"], sort=True):
        g = g[g["n_nll"] > 0]
        if g.empty:
            continue
        for half in HALVES:
            h = g[g["stream"].isin(halves[half])]
            rows.append(_half_row(h, str(name), float(frac), half, p))
    result = {
        "seed": p.seed,
        "method": f"streams permuted by rng_for(seed, {SPLIT_KEY!r}) (numpy PCG64 seeded with "
        "the seed and the key's CRC-32); the first ceil(S/2) screen candidates, the rest "
        "report the chosen policy's Δppl",
        "n_streams": len(streams),
        **{f"{half}_streams": halves[half] for half in HALVES},
    }
    return Selection(pd.DataFrame(rows), result, {"status": "ok"})


def _half_row(h: pd.DataFrame, name: str, frac: float, half: str, p: AnalysisParams) -> dict:
    """One policy's Δppl on one half's streams `h` (rows of `Quality.streams`)."""
    row: dict[str, Any] = {"policy": name, "fraction": frac, "half": half, "n_streams": len(h)}
    if h.empty:
        return row | {"dppl_pct": None, "dppl_ci_lo": None, "dppl_ci_hi": None}
    sum_dnll, n_nll = h["sum_dnll"].to_numpy(float), h["n_nll"].to_numpy(float)
    (iv,) = stream_bootstrap(
        ratio_stat(sum_dnll, n_nll, dppl_pct),
        len(h),
        p.n_boot,
        rng_for(p.seed, "selection", half, name, frac),
        p.ci_level,
    )
    return row | {"dppl_pct": iv.estimate, **iv.columns("dppl_")}
