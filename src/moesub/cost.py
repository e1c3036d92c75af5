"""The cost model: mean seconds per token from a replay's counters (hits, fetches, ...).

Its terms are the engine's (`moesub.engine`), one per thing a decode step really does:

- `token_overhead_s` once per token (starting and ending it: admissions landed, the final wait);
- `dense_layer_s` once per MoE layer (router, norm, attention and shared expert where the
  engine runs a model, the policy core's step, the host's bookkeeping);
- `expert_compute_s` per expert computed on the fast tier (hit, fetched, substitute, forced),
  for the tier and dtype it was calibrated on;
- `transfer_latency_s + expert_bytes / link_bandwidth_Bps` per synchronous copy (fetch, forced);
- `host_expert_compute_s` per expert computed by the slow tier's processor (host_compute);
- per background copy (admission, prefetch): `install_s` (installing a landed copy on the fast
  tier) plus the share `1 - background_overlap` of its link time that the decode does not hide.

Its constants are measured on the engine (`moesub.engine.calibrate`: fitted to timed engine runs)
or left at their defaults (Qwen3-Next-80B-A3B experts over PCIe 4); the simulator prices every
grid point with it, and the engine compares its measured time with it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# calibration files written before the overlap term carry this boolean instead
_LEGACY_OVERLAP = "background_shares_link"


@dataclass(frozen=True)
class CostModel:
    """Per-token time model. Defaults: Qwen3-Next-80B-A3B experts (bf16, 6 MiB) over PCIe 4."""

    link_bandwidth_Bps: float = 25e9  # slow tier -> fast tier
    transfer_latency_s: float = 10e-6  # fixed cost per synchronous expert copy
    expert_bytes: float = 3 * 2048 * 512 * 2
    expert_compute_s: float = 15e-6  # one expert, one token, fast device
    host_expert_compute_s: float = 400e-6  # one expert, one token, on the slow tier's processor
    dense_layer_s: float = 120e-6  # everything a layer costs besides routed experts and copies
    token_overhead_s: float = 0.0  # fixed cost per token (all layers together)
    # share of a background copy's link time hidden behind the decode (0: it delays the decode
    # as a synchronous copy would; 1: fully hidden)
    background_overlap: float = 0.0
    install_s: float = 0.0  # fast-tier work per background copy installed

    def __post_init__(self) -> None:
        if not 0.0 <= self.background_overlap <= 1.0:
            raise ValueError(f"background_overlap={self.background_overlap}: must be in [0, 1]")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "background_overlap" and v < 0:
                raise ValueError(f"cost model: {f.name}={v} must be >= 0")
        if self.link_bandwidth_Bps <= 0:
            raise ValueError(f"link_bandwidth_Bps={self.link_bandwidth_Bps} must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any], what: str = "cost model") -> CostModel:
        data = dict(data)
        if _LEGACY_OVERLAP in data:  # True: background copies delay the decode fully
            data.setdefault("background_overlap", 0.0 if data.pop(_LEGACY_OVERLAP) else 1.0)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{what}: unknown cost-model key(s) {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> CostModel:
        return cls.from_dict(json.loads(Path(path).read_text()), str(path))

    @property
    def copy_s(self) -> float:
        """Seconds of one synchronous expert copy."""
        return self.transfer_latency_s + self.expert_bytes / self.link_bandwidth_Bps

    @property
    def background_copy_s(self) -> float:
        """Seconds one background copy (admission or prefetch) adds to the decode."""
        link = self.expert_bytes / self.link_bandwidth_Bps
        return self.install_s + (1.0 - self.background_overlap) * link

    def time_per_token(self, counts: dict[str, float], num_layers: int) -> float:
        """Mean seconds per token from counters summed over `num_layers` layers (`tokens` counts
        token-layer steps; `prefetches` is optional)."""
        T = counts["tokens"] / num_layers
        computed = counts["hit"] + counts["fetch"] + counts["sub"] + counts["forced"]
        background = counts["admissions"] + counts.get("prefetches", 0)
        t = self.token_overhead_s + num_layers * self.dense_layer_s
        t += computed / T * self.expert_compute_s
        t += counts["host"] / T * self.host_expert_compute_s
        t += (counts["fetch"] + counts["forced"]) / T * self.copy_s
        t += background / T * self.background_copy_s
        return t
