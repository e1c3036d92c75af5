"""Trace-driven simulation: replay router logits through a grid of policies x cache sizes.

The replay itself is the C++ policy core (`_core.simulate_grid`, threads over grid points and
layers); this module builds the grid, turns counters into rates, and prices each grid point with
an explicit cost model (calibrated on the engine by `moesub.engine.calibrate`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import polars as pl

from moesub import _core
from moesub.io import write_json, write_parquet
from moesub.policy import CORE_BUILD_ID, Policy, _check_initial, _check_sizes, capacity_for

COUNTER_NAMES = (
    "tokens", "hit", "fetch", "sub", "host", "forced", "admission_requests", "admissions",
    "evictions",
)  # fmt: skip


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


def write_cost_model(calibration_path: str | None, overrides: dict, out_path: str) -> CostModel:
    """The engine's measured cost model (or the defaults) with config overrides, as JSON."""
    base = CostModel.from_json(calibration_path) if calibration_path else CostModel()
    unknown = set(overrides) - {f.name for f in fields(CostModel)}
    if unknown:
        raise ValueError(f"cost: unknown cost-model key(s) {sorted(unknown)}")
    cost = replace(base, **overrides)
    write_json(asdict(cost), out_path)
    return cost


@dataclass(frozen=True)
class GridPoint:
    name: str
    policy: Policy
    fraction: float


def simulate(
    streams: list[np.ndarray],
    k: int,
    grid: list[GridPoint],
    initial_sets: dict[int, np.ndarray] | None = None,
    cost: CostModel | None = None,
    n_threads: int | None = None,
    belady: bool = True,
) -> pl.DataFrame:
    """Replay every stream (float32 (T, L, E); caches restart per stream) for every grid point.

    `initial_sets` maps a capacity to its (L, C) resident set (default: experts 0..C-1).
    Returns one row per grid point and layer, plus a total row per grid point (layer = -1).
    """
    if not streams:
        raise ValueError("streams: need at least one router-logit stream")
    shapes = {s.shape[1:] for s in streams}
    if len(shapes) != 1:
        raise ValueError(f"streams: all streams need the same (L, E); got {sorted(shapes)}")
    for i, s in enumerate(streams):
        if s.dtype != np.float32 or s.ndim != 3:
            raise ValueError(f"streams[{i}]: expected float32 (T, L, E), got {s.dtype} {s.shape}")
        if not np.isfinite(s).all():
            raise ValueError(f"streams[{i}]: router logits contain NaN or inf")
    streams = [np.ascontiguousarray(s) for s in streams]
    L, E = streams[0].shape[1:]
    cost = cost or CostModel()
    capacities = [capacity_for(g.fraction, E) for g in grid]
    initials = []
    for g, C in zip(grid, capacities, strict=True):
        _check_sizes(E, k, C)
        init = None if initial_sets is None else initial_sets.get(C)
        if initial_sets is not None and init is None:
            raise ValueError(f"initial_sets: no resident set for capacity {C} ({g.name})")
        initials.append(_check_initial(init, (L, C), E))
    use_belady = [belady and g.policy.rule == "fetch_all" for g in grid]
    total_T = sum(s.shape[0] for s in streams)
    mass = [np.zeros((total_T, L), np.float64) for _ in grid]
    counters = np.zeros((len(grid), L, len(COUNTER_NAMES)), np.int64)
    belady_hits = np.zeros((len(grid), L), np.int64)
    args = [g.policy._core_args() for g in grid]
    _core.simulate_grid(
        streams, k,
        [a[0] for a in args], [a[1] for a in args], [a[2] for a in args],
        [a[3] for a in args], [a[4] for a in args],
        capacities, initials, use_belady, mass, counters, belady_hits,
        n_threads or os.cpu_count() or 1,
    )  # fmt: skip
    rows = []
    for gi, (g, C) in enumerate(zip(grid, capacities, strict=True)):
        for layer in [*range(L), -1]:
            if layer >= 0:
                c = dict(zip(COUNTER_NAMES, counters[gi, layer].tolist(), strict=True))
                m = mass[gi][:, layer]
                bel = belady_hits[gi, layer]
            else:
                c = dict(zip(COUNTER_NAMES, counters[gi].sum(0).tolist(), strict=True))
                m = mass[gi].ravel()
                bel = belady_hits[gi].sum()
            calls = c["tokens"] * k
            n_layers = L if layer < 0 else 1
            rows.append(
                {
                    "policy": g.name,
                    "fraction": g.fraction,
                    "capacity": C,
                    "layer": layer,
                    **c,
                    "hit_rate": c["hit"] / calls,
                    "sub_rate": c["sub"] / calls,
                    "mass_mean": float(m.mean()),
                    "mass_p50": float(np.quantile(m, 0.5)),
                    "mass_p90": float(np.quantile(m, 0.9)),
                    "mass_p99": float(np.quantile(m, 0.99)),
                    "mass_per_token": float(mass[gi].sum(1).mean()) if layer < 0 else None,
                    "est_time_per_token_s": cost.time_per_token(c, n_layers),
                    "belady_hit_rate": bel / calls if use_belady[gi] else None,
                }
            )
    return pl.DataFrame(rows)


def run_simulate(
    router_path: str,
    initial_sets_path: str | None,
    name: str,
    policy: dict,
    fraction: float,
    cost_path: str | None,
    out_path: str,
) -> None:
    """Snakemake entry point: one (policy, fraction) over a captured trace -> Parquet."""
    from moesub.capture import load_trace, read_initial_set

    pol = Policy.from_dict(policy)
    trace = load_trace(router_path)
    E, k = trace.meta["num_experts"], trace.meta["top_k"]
    C = capacity_for(fraction, E)
    initial = {C: read_initial_set(initial_sets_path, fraction)} if initial_sets_path else None
    cost = CostModel.from_json(cost_path) if cost_path else CostModel()
    df = simulate(trace.logits, k, [GridPoint(name, pol, fraction)], initial, cost)
    write_parquet(
        df,
        out_path,
        metadata={
            "policy": pol.to_dict(),
            "name": name,
            "fraction": fraction,
            "capacity": C,
            "cost_model": asdict(cost),
            "core_build_id": CORE_BUILD_ID,
            "router_trace": str(router_path),
        },
    )
