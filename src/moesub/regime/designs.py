"""The pinning and allocation designs on the evaluation trace and on its skew-matched twin.

A *design* is a configured policy whose cache is more than a plain uniform cache: a pin spec
(the calibration's hottest experts of each layer never evicted: an int, "50%", "C-k";
`moesub.slots`) or planned per-layer slots (`allocation: planned`, `moesub.allocation`). Its
*counterpart* is the same policy with neither (no pins, uniform slots). Both are replayed by the
simulator (`moesub.grid`, no Belady bound) at every given cache size in two worlds (`World`),
each cache laid out by the one resolver (`moesub.layout.build_layout`: capacities, initial
experts and pins per layer, as every stage lays out its caches):

- ``evaluation``: the evaluation capture; the pipeline's expert ranking and, for a planned
  design, its allocation artefact, as the simulate stage runs it;
- ``skew_matched``: the skew-matched evaluation trace (`moesub.skewmatch`); the skew-matched
  calibration trace's frequency ranking and, for a planned design, the split planned on that
  trace (`moesub.allocation.plan`), so each world's design is chosen on its own calibration.

How a design's gain over its counterpart changes from the first world to the second is how the
result would change under the real reference model's skew, the within-stream routing held
fixed. Designs that substitute by co-activation are left out (their table would have to be
rebuilt from the matched calibration).

`replay_designs` returns one row per (design, role, size) with the all-layer figures:
``hit_rate``; ``misses_per_token``, the calls not served by a resident expert (fetched,
substituted, computed on the host, forced) per token over all MoE layers; ``fetches_per_token``
(fetched + forced); ``sub_rate``; the per-layer ``capacities`` and ``pins`` as text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from moesub.config.policies import is_planned
from moesub.grid import GridPoint, simulate
from moesub.layout import build_layout
from moesub.slots import LAYOUT_KEYS, CacheSize, check_pin_spec


@dataclass(frozen=True)
class World:
    """A trace the designs replay on: `streams` (float32 (T, L, E) each) with their
    `lookahead` (None: none); `ranking`, the (L, E) expert ranking its caches start from
    (hottest first); `allocation(design, size)`, a planned design's per-layer capacities."""

    name: str
    streams: list[np.ndarray]
    lookahead: list[np.ndarray] | None
    ranking: np.ndarray
    allocation: Callable[[str, CacheSize], tuple[int, ...]]


def counterpart(spec: Mapping[str, Any]) -> tuple[dict[str, Any], str, str] | None:
    """A design's counterpart spec, what the design adds and what the counterpart is; None for
    a policy that is no design (no pins, uniform slots)."""
    pin = spec.get("pin", 0)
    parts = [(f"pins {pin}", "no pins")] if pin != 0 else []
    parts += [("planned slots", "uniform slots")] if is_planned(spec) else []
    if not parts:
        return None
    plain = {k: v for k, v in spec.items() if k not in LAYOUT_KEYS}
    return plain, ", ".join(c for c, _ in parts), ", ".join(b for _, b in parts)


def designs_of(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The policies that are designs (`counterpart`), those substituting by co-activation left
    out (module docs). A bad pin spec is an error naming the policy."""
    designs = {}
    for name, spec in policies.items():
        try:
            check_pin_spec(spec.get("pin", 0))
        except ValueError as e:
            raise ValueError(f"policy {name!r}: {e}") from None
        if counterpart(spec) is not None and spec.get("substitute_by") != "coactivation":
            designs[name] = dict(spec)
    return designs


def _text(values: Sequence[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def replay_designs(
    world: World, top_k: int, designs: Mapping[str, Mapping[str, Any]], sizes: Sequence[CacheSize]
) -> pl.DataFrame:
    """Every design and its counterpart at every cache size, replayed in `world` (module
    docs)."""
    L = world.ranking.shape[0]
    points, rows = [], []
    for name, spec in designs.items():
        found = counterpart(spec)
        if found is None:
            raise ValueError(f"design {name!r}: no pins and uniform slots: not a design")
        base, change, label = found
        for size in sizes:
            for role, s in (("design", dict(spec)), ("counterpart", base)):
                planned = world.allocation(name, size) if is_planned(s) else None
                layout = build_layout(world.ranking, size, s, top_k, planned)
                point = f"{name}|{role}|{size.label}"
                policy = layout.policy(s)
                points.append(
                    GridPoint(point, policy, layout.capacities, layout.initial, size.fraction)
                )
                rows.append(
                    {
                        "world": world.name, "design": name, "role": role, "change": change,
                        "counterpart": label, "size": size.label, "capacity": size.capacity,
                        "capacities": _text(layout.capacities), "pins": _text(layout.pins),
                    }
                )  # fmt: skip
    if not points:
        return pl.DataFrame()
    sim = simulate(world.streams, top_k, points, belady=False, lookahead=world.lookahead)
    for row, point in zip(rows, points, strict=True):
        t = sim.filter((pl.col("policy") == point.name) & (pl.col("layer") == -1)).row(
            0, named=True
        )
        tokens = t["tokens"] / L  # the total row counts every layer's tokens
        row.update(
            tokens=int(tokens),
            hit_rate=t["hit_rate"],
            misses_per_token=(t["tokens"] * top_k - t["hit"]) / tokens,
            fetches_per_token=(t["fetch"] + t["forced"]) / tokens,
            sub_rate=t["sub_rate"],
        )
    return pl.DataFrame(rows)
