"""The simulate stage: one (policy, cache size) replayed over a captured trace, priced by the cost
model (`moesub.grid.simulate`, the C++ core's grid replay), and the cost-model rule's JSON (the
engine's calibration with config overrides). The caches' layout (per-layer capacities, initial
experts, pins) comes from `moesub.artefacts.layout_for`.
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace

from moesub.artefacts import layout_for, load_trace
from moesub.coactivation import read_coactivation
from moesub.cost import CostModel
from moesub.grid import GridPoint, simulate
from moesub.io import write_json, write_parquet
from moesub.policy import CORE_BUILD_ID


def write_cost_model(calibration_path: str | None, overrides: dict, out_path: str) -> CostModel:
    """The engine's measured cost model (or the defaults) with config overrides, as JSON."""
    base = CostModel.from_json(calibration_path) if calibration_path else CostModel()
    unknown = set(overrides) - {f.name for f in fields(CostModel)}
    if unknown:
        raise ValueError(f"cost: unknown cost-model key(s) {sorted(unknown)}")
    cost = replace(base, **overrides)
    write_json(asdict(cost), out_path)
    return cost


def run_simulate(
    router_path: str,
    ranking_path: str,
    name: str,
    policy: dict,
    size: float | dict,
    cost_path: str | None,
    out_path: str,
    coactivation_path: str | None = None,
    allocation_path: str | None = None,
) -> None:
    """Snakemake entry point: one (policy, size) over a captured trace -> Parquet.

    `policy`: the config's policy dict (its pin spec and allocation resolved into the layout);
    `size`: a resolved cache size (`moesub.layout.CacheSize.to_dict`) or a fraction;
    `allocation_path`: the allocation artefact of a planned policy. A prefetching policy reads
    the trace's lookahead logits; `coactivation_path` (the model's coactivation.npz) is
    required by, and only read for, substitute_by='coactivation'.
    """
    if policy.get("substitute_by") == "coactivation" and coactivation_path is None:
        raise ValueError(
            f"policy {name!r}: substitute_by='coactivation' needs the co-activation table "
            "(coactivation_path)"
        )
    trace = load_trace(router_path, lookahead=int(policy.get("prefetch", 0)) > 0)
    E, k, L = trace.num_experts, trace.top_k, trace.num_layers
    layout = layout_for(ranking_path, size, policy, k, L, E, allocation_path)
    pol = layout.policy(policy)
    C = layout.size.capacity
    cost = CostModel.from_json(cost_path) if cost_path else CostModel()
    table = (
        read_coactivation(coactivation_path, L, E) if pol.substitute_by == "coactivation" else None
    )
    df = simulate(
        trace.logits, k,
        [GridPoint(name, pol, layout.capacities, layout.initial, layout.size.fraction)],
        cost, lookahead=trace.lookahead, coactivation=table,
    )  # fmt: skip
    write_parquet(
        df,
        out_path,
        metadata={
            "policy": dict(policy),
            "name": name,
            "fraction": layout.size.fraction,
            "capacity": C,
            "size": layout.size.to_dict(),
            "layout": layout.to_dict(),
            "cost_model": asdict(cost),
            "core_build_id": CORE_BUILD_ID,
            "router_trace": str(router_path),
            **({"coactivation": str(coactivation_path)} if table is not None else {}),
        },
    )
