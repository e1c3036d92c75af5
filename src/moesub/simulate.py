"""The simulate stage: one (policy, fraction) replayed over a captured trace (`moesub.grid`, the
C++ core's grid replay): the replay table, and every token-layer's counts beside it (the
pricing's input: the `price` stage prices them under each hardware profile, so a profile
change reruns no replay).
"""

from __future__ import annotations

import numpy as np

from moesub.artefacts import load_trace, read_initial_set
from moesub.coactivation import read_coactivation
from moesub.grid import GridPoint, replay
from moesub.io import write_parquet
from moesub.policy import CORE_BUILD_ID, TOKEN_LAYER_FIELDS, Policy, capacity_for
from moesub.token_counts import counts_table


def run_simulate(
    router_path: str,
    initial_sets_path: str | None,
    name: str,
    policy: dict,
    fraction: float,
    out_path: str,
    counts_path: str,
    coactivation_path: str | None = None,
) -> None:
    """Snakemake entry point: one (policy, fraction) over a captured trace -> the replay table
    (`out_path`) and its per-token-layer counts (`counts_path`: `stream, pos,
    token_layer_counts`, `moesub.token_counts`), Parquet.

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
    table = (
        read_coactivation(coactivation_path, L, E) if pol.substitute_by == "coactivation" else None
    )
    r = replay(
        trace.logits, k, [GridPoint(name, pol, C, initial, fraction)],
        lookahead=trace.lookahead, coactivation=table, token_counts=True,
    )  # fmt: skip
    meta = {
        "policy": pol.to_dict(),
        "name": name,
        "fraction": fraction,
        "capacity": C,
        "core_build_id": CORE_BUILD_ID,
        "router_trace": str(router_path),
        **({"coactivation": str(coactivation_path)} if table is not None else {}),
    }
    stream = np.repeat(trace.streams, r.stream_lengths)
    pos = np.concatenate([np.arange(n) for n in r.stream_lengths])
    counts = counts_table(stream, pos, r.token_counts[0])
    write_parquet(counts, counts_path, metadata={**meta, "token_layer_fields": TOKEN_LAYER_FIELDS})
    write_parquet(r.table(), out_path, metadata=meta)
