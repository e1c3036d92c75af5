"""The summary table: one row per (policy, fraction) of every per-policy table side by side.

Keys: every (policy, fraction) of quality, the simulate totals, the engine and generation;
then the policy's rule, tau, eviction and beta, its quality row, the simulator's hit and
substitution rates and time (`sim_*`), one engine device's time and speedups (a CUDA device if
one ran, else the first by name: `engine_device`) and, per generation task, its accuracy,
interval, n and agreement (`<task>_<column>`).

Entry point: `summary(quality, sim, engine, generation, p) -> Summary`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pandas as pd

from moesub.stats.load import missing
from moesub.stats.params import AnalysisParams

ENGINE_COLUMNS = (
    "policy",
    "fraction",
    "device",
    "time_per_token_s",
    "speedup_vs_fetch_every_miss",
    "speedup_vs_host_compute",
)
SIM_COLUMNS = {  # simulate total column -> summary column
    "hit_rate": "sim_hit_rate",
    "sub_rate": "sim_sub_rate",
    "est_time_per_token_s": "sim_time_per_token_s",
    "mass_mean": "sim_mass_mean",  # substituted gate mass per token-layer
}
GENERATION_COLUMNS = ("accuracy", "ci_low", "ci_high", "n", "agreement")


class Summary(NamedTuple):
    """`table`: one row per (policy, fraction) (module doc); `status`."""

    table: pd.DataFrame
    status: dict[str, Any]


def summary(
    quality: pd.DataFrame,
    sim: pd.DataFrame,
    engine: pd.DataFrame,
    generation: pd.DataFrame,
    p: AnalysisParams,
) -> Summary:
    """The summary from `Quality.table`, `Simulate.total`, `Engine.table` and
    `Generation.table` (any may be empty)."""
    keys = [df[["policy", "fraction"]] for df in (quality, sim, engine, generation) if not df.empty]
    if not keys:
        return Summary(pd.DataFrame(), missing("no per-policy artefacts at all"))
    s = pd.concat(keys).drop_duplicates().sort_values(["fraction", "policy"])
    s = s.reset_index(drop=True)
    pols = [p.policy(n) or {} for n in s["policy"]]
    for key in ("rule", "tau", "eviction", "beta"):
        s[key] = [pol.get(key) for pol in pols]
    if not quality.empty:
        s = s.merge(quality, on=["policy", "fraction"], how="left")
    if not sim.empty:
        sim_cols = sim[["policy", "fraction", *SIM_COLUMNS]].rename(columns=SIM_COLUMNS)
        s = s.merge(sim_cols, on=["policy", "fraction"], how="left")
    if not engine.empty:
        # one device per summary row: a CUDA device if one ran, else the first by name
        order = engine.assign(_cuda=~engine["device"].astype(str).str.startswith("cuda"))
        first = order.sort_values(["_cuda", "device"]).drop_duplicates(["policy", "fraction"])
        s = s.merge(
            first[list(ENGINE_COLUMNS)].rename(columns={"device": "engine_device"}),
            on=["policy", "fraction"],
            how="left",
        )
    if not generation.empty:
        for task in sorted(generation["task"].unique()):
            g = generation[generation["task"] == task][["policy", "fraction", *GENERATION_COLUMNS]]
            g = g.rename(columns={c: f"{task}_{c}" for c in GENERATION_COLUMNS})
            s = s.merge(g, on=["policy", "fraction"], how="left")
    return Summary(s, {"status": "ok"})
