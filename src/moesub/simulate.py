"""The simulate stage: one (policy, cache size) replayed over a captured trace (`moesub.grid`,
the C++ core's grid replay): the replay table, and every token-layer's counts beside it (the
pricing's input: the `price` stage prices them under each hardware profile, so a profile change
reruns no replay). The caches' layout (per-layer capacities, initial experts, pins) comes from
`moesub.artefacts.layout_for`.
"""

from __future__ import annotations

import numpy as np

from moesub.artefacts import layout_for, load_trace
from moesub.coactivation import read_coactivation
from moesub.grid import GridPoint, replay
from moesub.io import write_parquet
from moesub.policy import CORE_BUILD_ID, TOKEN_LAYER_FIELDS
from moesub.token_counts import counts_table


def run_simulate(
    router_path: str,
    ranking_path: str,
    name: str,
    policy: dict,
    size: float | dict,
    out_path: str,
    counts_path: str,
    coactivation_path: str | None = None,
    allocation_path: str | None = None,
) -> None:
    """Snakemake entry point: one (policy, size) over a captured trace -> the replay table
    (`out_path`) and its per-token-layer counts (`counts_path`: `stream, pos,
    token_layer_counts`, `moesub.token_counts`), Parquet.

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
    table = (
        read_coactivation(coactivation_path, L, E) if pol.substitute_by == "coactivation" else None
    )
    r = replay(
        trace.logits, k,
        [GridPoint(name, pol, layout.capacities, layout.initial, layout.size.fraction)],
        lookahead=trace.lookahead, coactivation=table, token_counts=True,
    )  # fmt: skip
    meta = {
        **layout.run_metadata(name, policy),
        "core_build_id": CORE_BUILD_ID,
        "router_trace": str(router_path),
        **({"coactivation": str(coactivation_path)} if table is not None else {}),
    }
    stream = np.repeat(trace.streams, r.stream_lengths)
    pos = np.concatenate([np.arange(n) for n in r.stream_lengths])
    counts = counts_table(stream, pos, r.token_counts[0])
    write_parquet(counts, counts_path, metadata={**meta, "token_layer_fields": TOKEN_LAYER_FIELDS})
    write_parquet(r.table(), out_path, metadata=meta)
