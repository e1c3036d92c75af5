"""The cache regime of a model: how its routing behaves under a partial expert cache, and how
the figures that depend on it would change under the real reference model's skew.

Modules: `measure` (the regime figures per MoE layer beside the study's, the verdict),
`matched` (static-skew measures beside the real model's, on the evaluation trace and its
skew-matched twin: `moesub.skewmatch`), `designs` (the pinning designs replayed on both traces),
`run` (the stage's entry point).
"""

from moesub.regime.matched import SKEW_COLUMNS, skew_table, skew_verdict
from moesub.regime.measure import (
    COMPARABLE_MARGIN,
    REFERENCES,
    REUSE_COLUMNS,
    REUSE_EDGES,
    Regime,
    gate_weights_by_rank,
    lookahead_recall,
    measure_regime,
    regime_from_files,
    reuse_distances,
    softmax_entropy,
    summarize,
    trace_regime,
    verdict,
)
from moesub.regime.run import RegimeRun, regime_from_captures, run_regime

__all__ = [
    "COMPARABLE_MARGIN",
    "REFERENCES",
    "REUSE_COLUMNS",
    "REUSE_EDGES",
    "SKEW_COLUMNS",
    "Regime",
    "RegimeRun",
    "gate_weights_by_rank",
    "lookahead_recall",
    "measure_regime",
    "regime_from_captures",
    "regime_from_files",
    "reuse_distances",
    "run_regime",
    "skew_table",
    "skew_verdict",
    "softmax_entropy",
    "summarize",
    "trace_regime",
    "verdict",
]
