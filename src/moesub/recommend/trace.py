"""A model given as a router trace (`moesub.traces.models`): no weights, so no Δppl and no
engine. Its rankings are the simulator's on each profile it was priced on (every one of
`hardware.price` but this_machine), built as any model's (`document.rankings`); per ranking:

- `within_budget` is null: there is no Δppl to screen;
- `fastest`: the fastest runnable policy (the tie rule as any choice's), its substituted gate
  mass per token-layer the quality proxy, labelled so (`quality_proxy`: with the mass
  hypothesis' r from a model of the same analysis where Δppl was measured);
- `lossless`: as any model's, Δppl 0 by construction (the policy substitutes nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from moesub.recommend.ranking import Choice, fastest_simplest
from moesub.vocabulary import ALL_RESIDENT

NO_DPPL = (
    "a trace model has no measured Δppl (no weights): see fastest and its substituted mass, "
    "the quality proxy"
)
PROXY_LABEL = "quality proxy: substituted mass, not a measured Δppl"


def mass_proxy(analysis: Mapping[str, Any], model: str, fraction: float) -> dict[str, Any]:
    """How well substituted mass stood for Δppl where Δppl was measured: the mass hypothesis'
    r of the other models (`analysis.json["mass_hypothesis"]`), the one at the nearest fraction
    with an r first."""
    entries = [e for e in analysis.get("mass_hypothesis") or [] if e.get("model", model) != model]
    entries.sort(key=lambda e: (e.get("r") is None, abs(float(e["fraction"]) - fraction)))
    out: dict[str, Any] = {
        "measure": "mean substituted gate mass per token-layer (simulated)",
        "label": PROXY_LABEL,
    }
    if not entries:
        return {**out, "r": None, "reason": "no model with measured Δppl in this analysis"}
    e = entries[0]
    return {
        **out,
        "r": e.get("r"),
        "from_model": e.get("model"),
        "from_fraction": float(e["fraction"]),
        "n_policies": e.get("n"),
        "reason": e.get("reason"),
    }


def trace_choices(ranked: pd.DataFrame, choices: Mapping[str, Choice]) -> dict[str, Choice]:
    """A trace model's choices of one ranking (module doc) from `ranked` (the ranking's
    candidates with their times) and `choices` (`ranking.choose`'s, whose lossless one holds)."""
    runnable = ranked[
        (ranked["policy"] != ALL_RESIDENT)
        & ~ranked["bound"].astype(bool)
        & ranked["time_per_token_s"].notna()
    ]
    fastest = (
        fastest_simplest(runnable)
        if not runnable.empty
        else Choice(None, "no runnable policy has a simulator time at this size")
    )
    return {
        "within_budget": Choice(None, NO_DPPL),
        "fastest": fastest,
        "lossless": choices["lossless"],
    }
