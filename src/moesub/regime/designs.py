"""The pinning designs on the evaluation trace and on its skew-matched twin.

A *design* is a configured policy whose cache is more than a plain cache: a pin count (the
calibration's hottest experts of each layer never evicted, `Policy.pin`). Its *counterpart* is
the same policy without pins. Both are replayed by the simulator (`moesub.grid`, no Belady
bound) at every given cache fraction in two worlds (`World`):

- ``evaluation``: the evaluation capture; initial sets from the pipeline's initial-sets
  artefact (the calibration's frequency ranking), as the simulate stage builds them;
- ``skew_matched``: the skew-matched evaluation trace (`moesub.skewmatch`); initial sets from
  the skew-matched calibration trace in the same way (its frequency ranking).

How a design's gain over its counterpart changes from the first world to the second is how the
result would change under the real reference model's skew, the within-stream routing held
fixed. Designs that substitute by co-activation are left out (their table would have to be
rebuilt from the matched calibration). Pins are integers (every layer, or one per layer);
share specs ("50%", "C-k") and planned per-layer allocations need the layout resolver, which
this branch does not have yet.

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

from moesub.config.names import number_label
from moesub.grid import GridPoint, simulate
from moesub.policy import Policy
from moesub.vocabulary import capacity_for


@dataclass(frozen=True)
class World:
    """A trace the designs replay on: `streams` (float32 (T, L, E) each) with their
    `lookahead` (None: none); `initial`, the (L, C) initial set at a cache fraction, hottest
    first (its calibration's frequency ranking)."""

    name: str
    streams: list[np.ndarray]
    lookahead: list[np.ndarray] | None
    initial: Callable[[float], np.ndarray]


def _pins(spec: Mapping[str, Any]) -> int | tuple[int, ...]:
    pin = spec.get("pin", 0)
    return tuple(pin) if isinstance(pin, list | tuple) else pin


def counterpart(spec: Mapping[str, Any]) -> tuple[dict[str, Any], str, str] | None:
    """A design's counterpart spec, what the design adds and what the counterpart is; None for
    a policy that is no design (no pins)."""
    pin = _pins(spec)
    if not any(np.atleast_1d(pin)):
        return None
    plain = {k: v for k, v in spec.items() if k != "pin"}
    return plain, f"pins {_text(np.atleast_1d(pin).tolist())}", "no pins"


def designs_of(policies: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The policies that are designs (`counterpart`), those substituting by co-activation
    left out (module docs). A pin that is no integer is an error naming the policy."""
    designs = {}
    for name, spec in policies.items():
        pin = _pins(spec)
        if not all(isinstance(p, int | np.integer) for p in np.atleast_1d(pin).tolist()):
            raise ValueError(
                f"policy {name!r}: pin {spec['pin']!r}: the regime replays integer pins only "
                "(an int, or one per MoE layer)"
            )
        if counterpart(spec) is not None and spec.get("substitute_by") != "coactivation":
            designs[name] = dict(spec)
    return designs


def _text(values: Sequence[int]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def replay_designs(
    world: World, top_k: int, designs: Mapping[str, Mapping[str, Any]], fractions: Sequence[float]
) -> pl.DataFrame:
    """Every design and its counterpart at every cache fraction, replayed in `world` (module
    docs)."""
    L, E = world.streams[0].shape[1:]
    points, rows = [], []
    for name, spec in designs.items():
        found = counterpart(spec)
        if found is None:
            raise ValueError(f"design {name!r}: no pins: not a design")
        base, change, label = found
        for fraction in fractions:
            capacity, initial = capacity_for(fraction, E), world.initial(fraction)
            for role, s in (("design", dict(spec)), ("counterpart", base)):
                policy = Policy.from_dict(s)
                pins = policy.layer_pins(L)
                points.append(GridPoint(f"{name}|{role}|{fraction}", policy, capacity, initial,
                                        fraction))  # fmt: skip
                rows.append(
                    {
                        "world": world.name, "design": name, "role": role, "change": change,
                        "counterpart": label, "size": f"f{number_label(fraction)}",
                        "capacity": capacity, "capacities": str(capacity), "pins": _text(pins),
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
