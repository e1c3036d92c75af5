"""fitz-tec's pin-list file (`EXPERT_CACHE_PIN_LIST`): per layer the experts to keep resident,
hottest first, which its patched llama.cpp pins (`fitz bench --pin-list`).

    # EXPERT_CACHE_PIN_LIST v1
    # (any comment lines)
    n_layer L
    n_expert E
    layer 0: 17 42 5 ...
    ...                      (every layer 0..L-1 once, in order; a layer may list nothing)

fitz-tec's `build_pin_list` orders each layer's experts by how often they are in a token's
top-k, ties to the lower id, and leaves out experts never selected: `frequency_order`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moesub.artefacts import frequency_sets
from moesub.io import atomic_path

HEADER = "# EXPERT_CACHE_PIN_LIST v1"
LAYER_LINE = re.compile(r"layer (\d+):((?: +\d+)*) *")


@dataclass(frozen=True)
class PinList:
    num_experts: int
    layers: tuple[tuple[int, ...], ...]  # per layer 0..L-1: experts, hottest first

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def frequency_order(counts: np.ndarray) -> list[list[int]]:
    """Per layer of (L, E) selection counts: the experts selected at least once, most selected
    first, ties to the lower id (`moesub.artefacts.frequency_sets`' order)."""
    order = frequency_sets(counts, counts.shape[1])  # (L, E)
    return [row[c[row] > 0].tolist() for row, c in zip(order, counts, strict=True)]


def _check_layer(where: str, ids: Sequence[int], num_experts: int) -> tuple[int, ...]:
    out = tuple(int(e) for e in ids)
    if any(not 0 <= e < num_experts for e in out):
        raise ValueError(f"{where}: expert ids outside [0, {num_experts})")
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: an expert is listed twice")
    return out


def write_pin_list(
    path: str | os.PathLike,
    by_layer: Sequence[Sequence[int]] | Mapping[int, Sequence[int]],
    num_experts: int,
    num_layers: int | None = None,
    comments: Sequence[str] = (),
) -> Path:
    """Write a pin list atomically. `by_layer`: per layer (the runtime's numbering) its experts
    hottest first; a mapping leaves the layers it lacks empty (non-MoE layers), up to
    `num_layers` (default: one past the largest layer given)."""
    if isinstance(by_layer, Mapping):
        L = max(by_layer, default=-1) + 1 if num_layers is None else num_layers
        if any(not 0 <= layer < L for layer in by_layer):
            raise ValueError(f"pin list: layer numbers must be in [0, {L})")
        rows = [by_layer.get(layer, ()) for layer in range(L)]
    else:
        rows = list(by_layer)
        if num_layers is not None and num_layers != len(rows):
            raise ValueError(f"pin list: {len(rows)} layers given, num_layers={num_layers}")
    if not rows:
        raise ValueError("pin list: no layers")
    rows = [_check_layer(f"pin list layer {i}", r, num_experts) for i, r in enumerate(rows)]
    lines = [
        HEADER,
        *(f"# {c}" for c in comments),
        f"n_layer {len(rows)}",
        f"n_expert {num_experts}",
    ]
    lines += [f"layer {i}: " + " ".join(map(str, r)) for i, r in enumerate(rows)]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Path(path)


def read_pin_list(path: str | os.PathLike) -> PinList:
    """Read and check a pin list (ValueError naming the file and line)."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].strip() != HEADER:
        raise ValueError(f"pin list {str(path)!r}, line 1: expected {HEADER!r}")
    sizes: dict[str, int] = {}
    layers: list[tuple[int, ...]] = []
    for n, raw in enumerate(lines[1:], 2):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"pin list {str(path)!r}, line {n}"
        key, _, value = line.partition(" ")
        if key in ("n_layer", "n_expert"):
            if key in sizes or layers or not value.isdigit():
                raise ValueError(f"{where}: {key} must come once, before the layers, as an integer")
            sizes[key] = int(value)
            continue
        m = LAYER_LINE.fullmatch(raw.rstrip("\n"))
        if m is None or len(sizes) < 2:
            raise ValueError(f"{where}: expected 'layer <i>: <ids>' after n_layer and n_expert")
        if int(m.group(1)) != len(layers):
            raise ValueError(f"{where}: layer {m.group(1)} where layer {len(layers)} was due")
        layers.append(_check_layer(where, m.group(2).split(), sizes["n_expert"]))
    if len(sizes) < 2 or len(layers) != sizes["n_layer"]:
        raise ValueError(
            f"pin list {str(path)!r}: {len(layers)} layer lines, n_layer {sizes.get('n_layer')}"
        )
    return PinList(num_experts=sizes["n_expert"], layers=tuple(layers))
