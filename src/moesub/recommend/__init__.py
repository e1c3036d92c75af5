"""The recommendation: which policy to run, per model, hardware and cache size.

Read from the analysis outputs only (nothing is recomputed). Quality depends on (policy, size):
Δppl % with its stream-bootstrap interval on all evaluation streams and on each half of the
analysis' seeded split of them (`moesub.stats.selection`). Time depends on (policy, size,
hardware) and on its source: the simulator's pricing, or an engine device's measurement; a
ranking never mixes the two (`ranking`).

Per ranking, two choices, each the fastest candidate that qualifies, ties to the simpler:
- `within_budget`: the upper CI bound of its Δppl on the *screen* half of the streams is <=
  `dppl_budget_pct` (the boundary counts); its Δppl is then quoted on the *report* half, the
  streams it was not chosen on, so the interval is not the winner of a search over them;
- `lossless`: Δppl exactly 0, on every stream (emulated) or by construction (simulated only).
No qualifying candidate: the choice is null with the reason. Times come from every stream: the
speed ranking reads no stream's Δppl, so the report half's Δppl stays out of the selection.

Modules: `candidates` (what each policy costs in quality and time, from the analysis tables),
`ranking` (time intervals, speedups, the choice and the tie rule), `document` (the JSON
document, `RECOMMENDATION_SCHEMA`, `write_recommendation`).
"""

from moesub.recommend.candidates import non_default_fields, quality_candidates, time_rows
from moesub.recommend.document import (
    INPUTS,
    RECOMMENDATION_SCHEMA,
    ModelFacts,
    RecommendParams,
    model_facts,
    rankings,
    recommend,
    write_recommendation,
)
from moesub.recommend.ranking import Choice, Timing, choose, fastest_simplest, simulator_timing

__all__ = [
    "INPUTS",
    "RECOMMENDATION_SCHEMA",
    "Choice",
    "ModelFacts",
    "RecommendParams",
    "Timing",
    "choose",
    "fastest_simplest",
    "model_facts",
    "non_default_fields",
    "quality_candidates",
    "rankings",
    "recommend",
    "simulator_timing",
    "time_rows",
    "write_recommendation",
]
