"""How config values become names, path components and Snakemake params."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Names become path components and Snakemake wildcard values.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Experiment B's factorial cells, rank bucket x weight band (moesub.expb.factorial): the runs'
# file names and the workflow's `cell` wildcard values.
FACTORIAL_CELLS = ("low_light", "low_heavy", "high_light", "high_heavy")


def check_name(name: str, where: str) -> None:
    """`name` (of a model, policy, ...) can be a path component; else ValueError naming `where`."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{where}: name {name!r} must match {_NAME_RE.pattern} (it becomes a path component)"
        )


def number_label(value: float) -> str:
    """Canonical text of a number in names and paths: 0.25 -> "0.25", 1.0 -> "1", 0.1 -> "0.1"."""
    return format(float(value), "g")


def canonical(value: Any) -> Any:
    """`value` with every mapping's keys sorted (recursively).

    Snakemake compares a job's params with the recorded ones in order; canonical params make
    reordering keys in config.yaml a no-op instead of a rerun of everything.
    """
    if isinstance(value, Mapping):
        return {str(k): canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value
