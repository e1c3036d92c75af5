"""The simulate stage: one (policy, fraction) replayed over a captured trace, priced by the cost
model (`moesub.grid.simulate`, the C++ core's grid replay), and the cost-model rule's JSON (the
engine's calibration with config overrides).
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace

from moesub.artefacts import load_trace, read_initial_set
from moesub.coactivation import read_coactivation
from moesub.cost import CostModel
from moesub.grid import GridPoint, simulate
from moesub.io import write_json, write_parquet
from moesub.policy import CORE_BUILD_ID, Policy, capacity_for


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
    initial_sets_path: str | None,
    name: str,
    policy: dict,
    fraction: float,
    cost_path: str | None,
    out_path: str,
    coactivation_path: str | None = None,
) -> None:
    """Snakemake entry point: one (policy, fraction) over a captured trace -> Parquet.

    A prefetching policy reads the trace's lookahead logits; `coactivation_path` (the model's
    coactivation.npz) is required by, and only read for, substitute_by='coactivation'.
    """
    pol = Policy.from_dict(policy)
    if pol.substitute_by == "coactivation" and coactivation_path is None:
        raise ValueError(
            f"policy {name!r}: substitute_by='coactivation' needs the co-activation table "
            "(coactivation_path)"
        )
    trace = load_trace(router_path, lookahead=pol.prefetch > 0)
    E, k, L = trace.num_experts, trace.top_k, trace.num_layers
    C = capacity_for(fraction, E)
    initial = read_initial_set(initial_sets_path, fraction) if initial_sets_path else None
    cost = CostModel.from_json(cost_path) if cost_path else CostModel()
    table = (
        read_coactivation(coactivation_path, L, E) if pol.substitute_by == "coactivation" else None
    )
    df = simulate(
        trace.logits, k, [GridPoint(name, pol, C, initial, fraction)], cost,
        lookahead=trace.lookahead, coactivation=table,
    )  # fmt: skip
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
            **({"coactivation": str(coactivation_path)} if table is not None else {}),
        },
    )
