"""Experiment B, factorial design: does a substitution's damage follow its gate weight or its rank?

Four cells, rank bucket x weight band (config `expb.designs.factorial`): `low_light`,
`low_heavy`, `high_light`, `high_heavy`. At one token-layer a cell's expert is the best (lowest)
tail rank of the cell's rank bucket whose normalized gate weight lies in the cell's band
`[lo, hi)`; the token-layer *supports* the cell when there is one. Each cell is one forced-
substitution run that substitutes that one expert at each of its planned token-layers, so the
cells differ only in which expert goes: the weight contrasts (heavy - light at a fixed rank
bucket) and the rank contrasts (high - low at a fixed weight band) read off the four runs.

Same token-layers. Along a token-layer the weights fall with the rank, so with the light band
below the heavy one and the low bucket below the high one no token-layer supports both
`low_light` and `high_heavy`: no token-layer supports all four cells (the feasibility table
reports the share that does). The cells are paired along the four contrasts instead: a token-
layer that supports both cells of a contrast is substituted in both runs (at different experts),
so that contrast compares the same token-layers. A token-layer supports at most one of a
contrast's two cells where the two cells' experts would be the same rank (single-rank buckets
leave the weight contrasts no shared token-layer: one expert has one weight).

**Plan** (`factorial_plan`), per (stream, layer) stratum of T token-layers, `u` the seeded hash
of (stream, pos, layer) (`moesub.expb.plan.token_layer_hash`):

1. the count `m = min(round(share * T), smallest cell support in the stratum)`, the same for
   every cell, so that every cell substitutes as often in every stream and layer;
2. two pairing rounds over the contrasts (`CONTRASTS`' order): each takes, in hash order,
   token-layers that support both its cells and that neither has yet, up to `m // 2` in the
   first round (the contrasts share the room evenly) and up to the room its cells have left in
   the second;
3. each cell takes the rest of its `m` from its own support: token-layers a partner cell (one it
   is contrasted with) has first, then the others, in hash order.

**Feasibility** (`factorial_feasibility`) is the plan applied to the calibration capture: per
cell its support, the count the plan reaches and the chosen experts' mean weight and rank; the
share of token-layers that support all four cells; the share of each contrast's token-layers its
two cells share; `max_share`, the share every cell reaches when each stratum takes its smallest
cell support (`share` is a cap: a larger one gives `max_share`). `check_feasible` refuses,
naming the key, a cell without support or an equal count of 0 ("infeasible").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moesub.artefacts import Trace
from moesub.config import FACTORIAL_CELLS, schema_defaults
from moesub.expb.plan import gate_weights, token_layer_hash
from moesub.params import options_from

KEY = "expb.designs.factorial"
CELLS = FACTORIAL_CELLS  # ("low_light", "low_heavy", "high_light", "high_heavy")
# (contrast, reference cell, other cell): the effect is other - reference. Weight contrasts
# first: the pairing rounds visit them in this order.
CONTRASTS = (
    ("weight_at_low", "low_light", "low_heavy"),
    ("weight_at_high", "high_light", "high_heavy"),
    ("rank_at_light", "low_light", "high_light"),
    ("rank_at_heavy", "low_heavy", "high_heavy"),
)
_PAIRS = tuple((CELLS.index(a), CELLS.index(b)) for _, a, b in CONTRASTS)
_PARTNERS = tuple(
    tuple(b if a == c else a for a, b in _PAIRS if c in (a, b)) for c in range(len(CELLS))
)
_DEFAULTS = schema_defaults(KEY)  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class FactorialSpec:
    """The cells and the count (config `expb.designs.factorial`; the analysis-only keys, e.g.
    `max_weight_gap`, are not read here). Rank buckets `[first, last]`, bands `[lo, hi)`."""

    low_ranks: tuple[int, int] = tuple(_DEFAULTS["low_ranks"])
    high_ranks: tuple[int, int] = tuple(_DEFAULTS["high_ranks"])
    light: tuple[float, float] = tuple(_DEFAULTS["light"])
    heavy: tuple[float, float] = tuple(_DEFAULTS["heavy"])
    share: float = _DEFAULTS["share"]

    def __post_init__(self) -> None:
        for name, kind in (("low_ranks", int), ("high_ranks", int), ("light", float),
                           ("heavy", float)):  # fmt: skip
            object.__setattr__(self, name, tuple(kind(v) for v in getattr(self, name)))
        object.__setattr__(self, "share", float(self.share))
        (lo1, lo2), (hi1, hi2) = self.low_ranks, self.high_ranks
        if not 2 <= lo1 <= lo2 < hi1 <= hi2:
            raise ValueError(
                f"{KEY}: rank buckets low_ranks={list(self.low_ranks)}, high_ranks="
                f"{list(self.high_ranks)} must be [first, last] ranges of tail ranks (>= 2), the "
                "low one below the high one"
            )
        (l1, l2), (h1, h2) = self.light, self.heavy
        if not 0 <= l1 < l2 <= h1 < h2 <= 1:
            raise ValueError(
                f"{KEY}: weight bands light={list(self.light)}, heavy={list(self.heavy)} must "
                "be [lo, hi) ranges in [0, 1], the light one below the heavy one"
            )
        if not 0 < self.share <= 1:
            raise ValueError(f"{KEY}.share={self.share} must be in (0, 1]")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any] | None) -> FactorialSpec:
        """From the config section (every key optional; `enabled` and the analysis' keys are
        the workflow's and the analysis's, not the plan's)."""
        spec = {k: v for k, v in dict(spec or {}).items() if k not in ("enabled", "max_weight_gap")}
        return options_from(cls, spec, KEY, section=KEY)

    def cell(self, name: str) -> tuple[tuple[int, int], tuple[float, float]]:
        """(rank bucket, weight band) of a cell."""
        ranks, band = name.split("_")
        return getattr(self, f"{ranks}_ranks"), getattr(self, band)

    def as_dict(self) -> dict[str, Any]:
        return {
            "low_ranks": list(self.low_ranks),
            "high_ranks": list(self.high_ranks),
            "light": list(self.light),
            "heavy": list(self.heavy),
            "share": self.share,
        }


def cell_ranks(weights: np.ndarray, spec: FactorialSpec) -> np.ndarray:
    """(N, 4) int: per row of gate weights (N, k) in rank order, the rank index (0-based) of
    each cell's expert (`CELLS` order), -1 where the row does not support the cell."""
    w = np.asarray(weights, dtype=np.float64)
    k = w.shape[1]
    if spec.high_ranks[1] > k:
        raise ValueError(
            f"{KEY}.high_ranks={list(spec.high_ranks)} reaches past the router's top-k = {k}"
        )
    out = np.full((w.shape[0], len(CELLS)), -1, dtype=np.int64)
    for c, name in enumerate(CELLS):
        (first, last), (lo, hi) = spec.cell(name)
        tail = w[:, first - 1 : last]  # (N, ranks of the bucket)
        ok = (tail >= lo) & (tail < hi)
        has = ok.any(axis=1)
        out[has, c] = np.argmax(ok[has], axis=1) + first - 1  # first True = the best rank
    return out


def select_stratum(support: np.ndarray, u: np.ndarray, m: int) -> np.ndarray:
    """(T, 4) bool: the token-layers each cell substitutes in one (stream, layer) stratum.

    `support` (T, 4) bool, `u` (T,) the hash, `m` the count per cell (<= every cell's support).
    Steps 2 and 3 of the module docstring: every cell gets exactly m, from its own support.
    """
    support = np.asarray(support, dtype=bool)
    if m > support.sum(axis=0).min():
        raise ValueError(f"count {m} exceeds a cell's support {support.sum(axis=0).tolist()}")
    order = np.argsort(u, kind="stable")
    chosen = np.zeros_like(support)
    for first_round in (True, False):
        for a, b in _PAIRS:
            room = m - max(chosen[:, a].sum(), chosen[:, b].sum())
            n = min(room, m // 2) if first_round else room
            free = support[:, a] & support[:, b] & ~chosen[:, a] & ~chosen[:, b]
            take = order[free[order]][:n]
            chosen[take, a] = chosen[take, b] = True
    for c in range(len(CELLS)):
        free = support[:, c] & ~chosen[:, c]
        near = chosen[:, list(_PARTNERS[c])].any(axis=1)
        ranked = np.r_[order[(free & near)[order]], order[(free & ~near)[order]]]
        chosen[ranked[: m - chosen[:, c].sum()], c] = True
    return chosen


@dataclass
class FactorialPlan:
    """Which expert each cell substitutes on the streams of a trace. `ids[cell][i]` (T, L, k)
    int32: the expert id planned at (pos, layer, rank) of stream `streams[i]`, -1 elsewhere (one
    rank at most per token-layer). Figures are per cell (`CELLS` order) or per contrast."""

    streams: list[int]
    ids: dict[str, list[np.ndarray]]
    token_layers: int  # every token-layer of the trace
    eligible: dict[str, int]  # token-layers that support the cell
    all_cells: float  # share of the token-layers that support all four cells
    count: int  # token-layers each cell substitutes (the same for every cell)
    stream_counts: list[int]  # per stream, the same for every cell
    max_share: float  # the share when every stratum takes its smallest cell support
    shared: dict[str, float]  # per contrast: share of its cells' count they share
    mean_weight: dict[str, float | None]  # planned experts' mean gate weight
    mean_rank: dict[str, float | None]  # and mean rank (1-based)

    @property
    def support(self) -> dict[str, float]:
        """Per cell, the share of the token-layers that support it."""
        return {c: n / self.token_layers for c, n in self.eligible.items()}

    @property
    def realized_share(self) -> float:
        return self.count / self.token_layers

    def summary(self) -> dict[str, Any]:
        """The plan's figures (no ids): run metadata and the feasibility table's metadata."""
        return {
            "token_layers": self.token_layers,
            "count": self.count,
            "realized_share": self.realized_share,
            "max_share": self.max_share,
            "all_cells": self.all_cells,
            "support": self.support,
            "shared": self.shared,
            "mean_weight": self.mean_weight,
            "mean_rank": self.mean_rank,
        }


def factorial_plan(trace: Trace, spec: FactorialSpec, seed: int) -> FactorialPlan:
    """The factorial design's plan over every stream of `trace` (module docstring)."""
    k, L = trace.top_k, trace.num_layers
    ids: dict[str, list[np.ndarray]] = {c: [] for c in CELLS}
    n_cells = len(CELLS)
    supported = np.zeros(n_cells, dtype=np.int64)
    all_cells = max_count = 0
    shared = np.zeros(len(_PAIRS))
    w_sum, r_sum = np.zeros(n_cells), np.zeros(n_cells)
    stream_counts = []
    for stream, z in zip(trace.streams, trace.logits, strict=True):
        w, sel = gate_weights(z, k)  # (T, L, k) each
        T = z.shape[0]
        ranks = cell_ranks(w.reshape(-1, k), spec).reshape(T, L, n_cells)
        u = token_layer_hash(seed, stream, T, L)  # (T, L)
        chosen = np.zeros((T, L, n_cells), dtype=bool)
        for layer in range(L):
            support = ranks[:, layer] >= 0  # (T, 4)
            cap = int(support.sum(axis=0).min())
            max_count += cap
            m = min(int(np.floor(spec.share * T + 0.5)), cap)
            chosen[:, layer] = select_stratum(support, u[:, layer], m)
        support = ranks >= 0  # (T, L, 4)
        supported += support.sum(axis=(0, 1))
        all_cells += int(support.all(axis=2).sum())
        shared += [(chosen[..., a] & chosen[..., b]).sum() for a, b in _PAIRS]
        stream_counts.append(int(chosen[..., 0].sum()))
        rank_at = np.where(chosen, ranks, -1)  # (T, L, 4)
        for c, name in enumerate(CELLS):
            r = rank_at[..., c]
            at = np.flatnonzero(r.reshape(-1) >= 0)
            rr = r.reshape(-1)[at]
            w_sum[c] += w.reshape(-1, k)[at, rr].sum()
            r_sum[c] += (rr + 1).sum()
            planned = np.full((T * L, k), -1, dtype=np.int32)
            planned[at, rr] = sel.reshape(-1, k)[at, rr]
            ids[name].append(planned.reshape(T, L, k))
    n = sum(z.shape[0] for z in trace.logits) * L
    count = int(sum(stream_counts))
    return FactorialPlan(
        streams=list(trace.streams),
        ids=ids,
        token_layers=n,
        eligible={c: int(s) for c, s in zip(CELLS, supported, strict=True)},
        all_cells=all_cells / n,
        count=count,
        stream_counts=stream_counts,
        max_share=max_count / n,
        shared={name: float(s / count) if count else 0.0
                for (name, _, _), s in zip(CONTRASTS, shared, strict=True)},
        mean_weight={c: float(w_sum[i] / count) if count else None for i, c in enumerate(CELLS)},
        mean_rank={c: float(r_sum[i] / count) if count else None for i, c in enumerate(CELLS)},
    )  # fmt: skip


def feasibility_table(plan: FactorialPlan, spec: FactorialSpec) -> pl.DataFrame:
    """One row per cell of the plan made on the calibration capture."""
    rows = []
    for c in CELLS:
        ranks, band = spec.cell(c)
        rows.append(
            {
                "cell": c,
                "rank_first": ranks[0],
                "rank_last": ranks[1],
                "weight_lo": band[0],
                "weight_hi": band[1],
                "token_layers": plan.token_layers,
                "eligible": plan.eligible[c],
                "support": plan.support[c],
                "count": plan.count,
                "realized_share": plan.realized_share,
                "mean_weight": plan.mean_weight[c],
                "mean_rank": plan.mean_rank[c],
            }
        )
    return pl.DataFrame(rows)


def check_feasible(plan: FactorialPlan, spec: FactorialSpec, what: str) -> None:
    """Raise ValueError naming `expb.designs.factorial` ("infeasible") when a cell has no
    support on `what` (e.g. "the calibration capture") or no (stream, layer) supports every cell
    (the equal count is 0)."""
    empty = [c for c in CELLS if plan.eligible[c] == 0]
    if empty:
        cells = "; ".join(
            f"{c} (ranks {spec.cell(c)[0][0]}-{spec.cell(c)[0][1]}, weight in "
            f"[{spec.cell(c)[1][0]:g}, {spec.cell(c)[1][1]:g}))"
            for c in empty
        )
        raise ValueError(
            f"{KEY}: infeasible: no token-layer of {what} ({plan.token_layers}) supports {cells}; "
            "move the rank buckets or widen the weight bands (low_ranks, high_ranks, light, heavy)"
        )
    if plan.count == 0:
        support = ", ".join(f"{c} {plan.eligible[c]}" for c in CELLS)
        raise ValueError(
            f"{KEY}: infeasible: no (stream, layer) of {what} has a token-layer for every cell, "
            f"so the equal count per cell is 0 (token-layers supporting each cell: {support})"
        )
