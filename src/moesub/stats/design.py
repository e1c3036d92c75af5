"""The design space (policy v2, docs/policy-semantics.md): every simulated policy by family.

Families: `study` (the v1 rules, LRU / LFU, admission), `host_compute` (every miss on the host),
and one per v2 mechanism: `prefetch` (prefetch > 0), `cache_prior` (route_bias > 0), `hybrid`
(light misses on the host), `buddy` (co-activation substitutes); a policy using several
mechanisms belongs to the first of that order (`features` lists them all). A policy with
eviction `belady` is the offline *bound* of the rule it replaces the eviction of: it is never a
candidate, and each online policy's `belady_gap` is the hit rate its bound adds.

Per (policy, fraction), `design_space`: hit rate, misses per token (experts selected but not
resident, summed over the layers), synchronous copies and prefetches per token, substituted
mass per token-layer, the simulator's estimated time per token (its counts priced on
`this_machine`, `moesub.pricing`: prefetches are priced as background copies), Δppl % with its
interval where emulated (`dppl_source`: `emulated`; `exact` for a lossless policy, whose
Δppl is 0 by construction; else null), the bound's hit rate and the gap, and two Pareto fronts
over the candidates of a fraction: `frontier` (time vs Δppl, where Δppl is known) and
`frontier_mass` (time vs the gate mass moved off the router's choice per token-layer,
substituted plus rerouted: the simulate-only proxy for quality, every candidate).
`design_families`: per family and fraction, its best policy and how many of the family's
policies sit on each front, beside the study's `quality` and `speed` policies (`REFERENCES`).
The best policy (`best_by`): the fastest whose Δppl is known and at most `quality`'s
(`within_quality`), else the one with the smallest known Δppl (`least_dppl`), else the fastest
(`fastest`, Δppl unknown).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from moesub.config import POLICY_DEFAULTS
from moesub.policy import OFFLINE_EVICTIONS, STATUS_NAMES, Policy
from moesub.slots import LAYOUT_KEYS, policy_fields
from moesub.stats.load import missing
from moesub.stats.params import AnalysisParams
from moesub.stats.timing import pareto_front

FAMILIES = ("study", "host_compute", "prefetch", "cache_prior", "hybrid", "buddy")
# v2 mechanism -> its family, in the order that assigns a policy using several
MECHANISMS = (
    ("cache_prior", lambda p: p.route_bias > 0),
    ("prefetch", lambda p: p.prefetch > 0),
    ("hybrid", lambda p: p.light_miss == "host"),
    ("buddy", lambda p: p.substitute_by == "coactivation"),
)
# an expert selected but not resident: every status but a hit
MISS_COLUMNS = tuple(name for name in STATUS_NAMES if name != "hit")
REFERENCES = ("quality", "speed")  # the study's policies each family is set beside


def features(p: Policy) -> list[str]:
    """The v2 mechanisms a policy uses, in `MECHANISMS` order."""
    return [name for name, uses in MECHANISMS if uses(p)]


def family(p: Policy) -> str:
    used = features(p)
    if used:
        return used[0]
    return "host_compute" if p.rule == "host_compute" else "study"


def lossless(p: Policy) -> bool:
    """The policy computes exactly the original model: nothing is substituted or rerouted."""
    return p.route_bias == 0 and (p.rule in ("fetch_all", "host_compute") or p.light_miss == "host")


def bound_key(p: Policy) -> tuple[Any, ...]:
    """What a policy and its Belady bound share: every field but the eviction."""
    d = p.to_dict()
    d.pop("eviction")
    return tuple(sorted(d.items()))


class DesignSpace(NamedTuple):
    """`table`: per simulated (policy, fraction) its family, figures, bound and fronts
    (`design_space.parquet`); `families`: per (family, fraction) its best policy
    (`design_families.parquet`); `status`."""

    table: pd.DataFrame
    families: pd.DataFrame
    status: dict[str, Any]


def design_space(
    sim: pd.DataFrame, layers: pd.DataFrame, quality: pd.DataFrame, p: AnalysisParams
) -> DesignSpace:
    """The design space from the simulate totals `sim` and per-layer rows `layers`
    (`Simulate`) and the Δppl of the emulated policies (`quality`, `Quality.table`)."""
    if sim.empty:
        return DesignSpace(pd.DataFrame(), pd.DataFrame(), missing("no simulate artefacts"))
    rows, unknown = [], []
    for r in sim.to_dict("records"):
        spec = p.policy(r["policy"])
        if spec is None:
            unknown.append(r["policy"])
            continue
        rows.append(_row(r, spec, layers))
    if not rows:
        why = f"no known policy among the simulated {unknown}"
        return DesignSpace(pd.DataFrame(), pd.DataFrame(), missing(why))
    ds = pd.DataFrame(rows)
    ds = _with_quality(ds, quality)
    ds = _with_bounds(ds)
    ds["frontier"] = ds["frontier_mass"] = False
    for _, idx in ds.groupby("fraction").groups.items():
        cand = ds.loc[idx]
        cand = cand[~cand["bound"]]
        ds.loc[cand.index, "frontier"] = pareto_front(
            cand["est_time_per_token_s"], cand["dppl_pct"]
        )
        ds.loc[cand.index, "frontier_mass"] = pareto_front(
            cand["est_time_per_token_s"], cand["moved_mass_per_token_layer"]
        )
    ds = ds.sort_values(["fraction", "family", "est_time_per_token_s", "policy"], ignore_index=True)
    status = (
        {"status": "ok"}
        if not unknown
        else {"status": "partial", "reason": f"policies without a definition: {unknown}"}
    )
    return DesignSpace(ds.drop(columns=["bound_key"]), _families(ds), status)


def _row(r: dict[str, Any], spec: dict[str, Any], layers: pd.DataFrame) -> dict[str, Any]:
    p = Policy.from_dict(policy_fields(spec))
    # the layout (pin spec, allocation) is part of what a policy and its bound share; written
    # as the config writes it (a pin spec is a count, "50%" or "C-k": one string column)
    layout = tuple((key, str(spec.get(key, POLICY_DEFAULTS[key]))) for key in LAYOUT_KEYS)
    per_layer = layers[(layers["policy"] == r["policy"]) & (layers["fraction"] == r["fraction"])]
    n_layers = len(per_layer) or 1
    tokens = float(r["tokens"]) / n_layers  # the total row counts token-layers

    def per_token(*cols: str) -> float:
        return float(sum(_count(r, c) for c in cols)) / tokens if tokens else math.nan

    return {
        "policy": r["policy"],
        "fraction": float(r["fraction"]),
        "family": family(p),
        "features": ",".join(features(p)),
        "rule": p.rule,
        "tau": p.tau,
        "eviction": p.eviction,
        "beta": p.beta,
        "prefetch": p.prefetch,
        "route_bias": p.route_bias,
        "light_miss": p.light_miss,
        "substitute_by": p.substitute_by,
        **{key: str(value) for key, value in layout},  # as written: a pin is 13, "50%", "C-k"
        "bound": p.eviction in OFFLINE_EVICTIONS,
        "lossless": lossless(p),
        "hit_rate": float(r["hit_rate"]),
        "misses_per_token": per_token(*MISS_COLUMNS),
        "copies_per_token": per_token("fetch", "forced"),
        "prefetches_per_token": per_token("prefetches"),
        "host_per_token": per_token("host"),
        "mass_per_token_layer": float(r["mass_mean"]),
        "rerouted_per_token_layer": _float(r.get("rerouted_mean"), 0.0),
        # what the simulator sees of a quality loss: gate mass substituted or rerouted
        "moved_mass_per_token_layer": float(r["mass_mean"]) + _float(r.get("rerouted_mean"), 0.0),
        "est_time_per_token_s": float(r["est_time_per_token_s"]),
        "bound_key": (*bound_key(p), *layout),
        "builtin_belady": _float(r.get("belady_hit_rate")),
        # the simulator's built-in bound (fetch_all) holds for demand paging of v1's selections
        "v1_selection": p.prefetch == 0 and p.route_bias == 0,
    }


def _count(r: dict[str, Any], col: str) -> float:
    """A counter of a simulate row; 0 where an older artefact has no such column."""
    return _float(r.get(col), 0.0)


def _float(v: Any, default: float = math.nan) -> float:
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _with_quality(ds: pd.DataFrame, q: pd.DataFrame) -> pd.DataFrame:
    cols = ["dppl_pct", "dppl_ci_lo", "dppl_ci_hi"]
    if q.empty:
        ds[cols] = math.nan
    else:
        ds = ds.merge(q[["policy", "fraction", *cols]], on=["policy", "fraction"], how="left")
    emulated = ds["dppl_pct"].notna()
    exact = ~emulated & ds["lossless"]
    ds.loc[exact, "dppl_pct"] = 0.0
    ds["dppl_source"] = np.where(emulated, "emulated", np.where(exact, "exact", None))
    return ds


def _with_bounds(ds: pd.DataFrame) -> pd.DataFrame:
    """Each online policy's Belady bound: the simulated `belady` policy with every other field
    equal, else (fetch_all without prefetch or route_bias) the simulator's built-in bound of the
    same run."""
    bounds = {
        (row.fraction, row.bound_key): (row.policy, row.hit_rate)
        for row in ds[ds["bound"]].itertuples()
    }
    names, rates = [], []
    for row in ds.itertuples():
        name, rate = bounds.get((row.fraction, row.bound_key), (None, math.nan))
        if row.bound:
            name, rate = None, math.nan
        elif name is None and math.isfinite(row.builtin_belady) and row.v1_selection:
            name, rate = "(built-in)", row.builtin_belady
        names.append(name)
        rates.append(rate)
    ds["belady_policy"] = names
    ds["belady_hit_rate"] = rates
    ds["belady_gap"] = ds["belady_hit_rate"] - ds["hit_rate"]
    return ds.drop(columns=["builtin_belady", "v1_selection"])


def best_of(g: pd.DataFrame, budget: float) -> tuple[pd.Series, str]:
    """A family's best policy and the criterion that chose it (module doc); `budget`: the
    quality reference's Δppl (NaN: none)."""
    known = g[g["dppl_pct"].notna()]
    within = known[known["dppl_pct"] <= budget] if math.isfinite(budget) else known.iloc[:0]
    if not within.empty:
        return within.sort_values(["est_time_per_token_s", "policy"]).iloc[0], "within_quality"
    if not known.empty:
        order = ["dppl_pct", "est_time_per_token_s", "policy"]
        return known.sort_values(order).iloc[0], "least_dppl"
    return g.sort_values(["est_time_per_token_s", "policy"]).iloc[0], "fastest"


def _families(ds: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (frac, fam), g in ds[~ds["bound"]].groupby(["fraction", "family"], sort=True):
        here = ds[ds["fraction"] == frac].set_index("policy")
        refs = {
            f"{ref}_{col}": float(here.at[ref, col]) if ref in here.index else math.nan
            for ref in REFERENCES
            for col in ("dppl_pct", "misses_per_token", "est_time_per_token_s")
        }
        best, best_by = best_of(g, refs[f"{REFERENCES[0]}_dppl_pct"])
        rows.append(
            {
                "fraction": frac,
                "family": fam,
                "n_policies": len(g),
                "best_policy": best["policy"],
                "best_by": best_by,
                "best_hit_rate": best["hit_rate"],
                "best_misses_per_token": best["misses_per_token"],
                "best_time_per_token_s": best["est_time_per_token_s"],
                "best_dppl_pct": best["dppl_pct"],
                "best_dppl_ci_lo": best["dppl_ci_lo"],
                "best_dppl_ci_hi": best["dppl_ci_hi"],
                "best_dppl_source": best["dppl_source"],
                "best_belady_gap": best["belady_gap"],
                "on_frontier": int(g["frontier"].sum()),
                "on_frontier_mass": int(g["frontier_mass"].sum()),
                **refs,
            }
        )
    return pd.DataFrame(rows)
