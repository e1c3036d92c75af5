"""The cost model: mean seconds per token from a replay's counters (hits, fetches, ...).

Its constants are measured on the engine (`moesub.engine.calibrate`) or left at their defaults
(Qwen3-Next-80B-A3B experts over PCIe 4); the simulator prices every grid point with it, and the
engine compares its measured time with it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    """Per-token time model. Defaults: Qwen3-Next-80B-A3B experts (bf16, 6 MiB) over PCIe 4."""

    link_bandwidth_Bps: float = 25e9  # slow tier -> fast tier
    transfer_latency_s: float = 10e-6  # fixed cost per synchronous expert copy
    expert_bytes: float = 3 * 2048 * 512 * 2
    expert_compute_s: float = 15e-6  # one expert, one token, fast device
    host_expert_compute_s: float = 400e-6  # one expert, one token, on the slow tier's processor
    dense_layer_s: float = 120e-6  # attention, router, shared expert of one layer
    background_shares_link: bool = True  # admissions compete with synchronous fetches

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> CostModel:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown cost-model key(s) {sorted(unknown)}")
        return cls(**data)

    def time_per_token(self, counts: dict[str, float], num_layers: int) -> float:
        """Mean seconds per token from counters summed over `num_layers` layers."""
        T = counts["tokens"] / num_layers
        copy_s = self.transfer_latency_s + self.expert_bytes / self.link_bandwidth_Bps
        t = num_layers * self.dense_layer_s
        t += (
            (counts["hit"] + counts["fetch"] + counts["sub"] + counts["forced"])
            / T
            * (self.expert_compute_s)
        )
        t += counts["host"] / T * self.host_expert_compute_s
        t += (counts["fetch"] + counts["forced"]) / T * copy_s
        if self.background_shares_link:
            t += counts["admissions"] / T * self.expert_bytes / self.link_bandwidth_Bps
        return t
