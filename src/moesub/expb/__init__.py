"""Experiment B: does the *composition* of substitutions matter at equal substituted mass?

Two pre-registered designs side by side (config `expb.designs`), each with two conditions,
heavy (one expert) and light (several smaller ones), at a target mean mass m* per token-layer:

- `study` (the reference study's design): per token-layer, heavy = the largest tail weight
  <= m*, light = the ascending prefix summing to <= m* (>= 2 experts), both from the live gate
  weights. The conditions substitute at different token-layers and ranks, and light often
  realizes far less mass than heavy: kept so the study's result can be reproduced and compared.
- `matched`: per token-layer, heavy = one tail expert of weight w_H near `heavy_mass`, light =
  >= 3 other tail experts, each <= w_H / 2, summing to w_H within 5%, at the *same* token-layers
  (a seeded hash subsample of the common support, sized to reach m*).

A third design separates the rank of a substituted expert from its weight (in `matched` the heavy
expert is nearly always rank 2 and the light ones far down the tail):

- `factorial`: four cells, rank bucket (low, high) x gate-weight band (light, heavy), each one
  run substituting one tail expert per planned token-layer, equal counts per cell in every
  (stream, layer), the two cells of each contrast at the same token-layers where support allows.

Modules: `select` (the selection rules, `matched_masks` the entry point tools outside the repo
call), `plan` (feasibility on the calibration capture, the matched plan), `factorial` (the
factorial design's cells, plan and feasibility), `run` (the forced substitution emulation and
the stage entry points). The statistics are in `moesub.stats`.
"""

from moesub.expb.factorial import (
    CELLS,
    CONTRASTS,
    FactorialPlan,
    FactorialSpec,
    cell_ranks,
    check_feasible,
    factorial_plan,
    select_stratum,
)
from moesub.expb.plan import (
    FEASIBILITY_GRID,
    MatchedPlan,
    check_targets,
    feasibility_table,
    gate_weights,
    matched_plan,
    token_layer_hash,
)
from moesub.expb.run import (
    CONDITIONS,
    DESIGNS,
    ExpBParams,
    ForcedRouter,
    PlannedIds,
    StudyRule,
    expb_streams,
    run_expb,
    run_factorial,
    run_factorial_feasibility,
    run_feasibility,
)
from moesub.expb.select import (
    HEAVY_TOLERANCE,
    LIGHT_MAX_RATIO,
    LIGHT_SUM_TOLERANCE,
    MIN_LIGHT,
    matched_masks,
    select_heavy,
    select_light,
    select_substitutions,
)

__all__ = [
    "CELLS",
    "CONDITIONS",
    "CONTRASTS",
    "DESIGNS",
    "FEASIBILITY_GRID",
    "HEAVY_TOLERANCE",
    "LIGHT_MAX_RATIO",
    "LIGHT_SUM_TOLERANCE",
    "MIN_LIGHT",
    "ExpBParams",
    "FactorialPlan",
    "FactorialSpec",
    "ForcedRouter",
    "MatchedPlan",
    "PlannedIds",
    "StudyRule",
    "cell_ranks",
    "check_feasible",
    "check_targets",
    "expb_streams",
    "factorial_plan",
    "feasibility_table",
    "gate_weights",
    "matched_masks",
    "matched_plan",
    "run_expb",
    "run_factorial",
    "run_factorial_feasibility",
    "run_feasibility",
    "select_heavy",
    "select_light",
    "select_stratum",
    "select_substitutions",
    "token_layer_hash",
]
