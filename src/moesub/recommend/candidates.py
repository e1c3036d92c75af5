"""The candidates of a recommendation, read from the analysis outputs (nothing is recomputed).

Quality depends on (policy, cache size) only (`quality_candidates`): Δppl % on all evaluation
streams (`summary`), on the screen half and on the report half of the selection split
(`selection`, `moesub.stats.selection`), whether the policy is lossless, its family and hit
rate (`design_space`; the simulator's replay of the evaluation streams, emulate's where the
policy was not simulated). Time depends on (policy, size, hardware) and on who measured it
(`time_rows`): the simulator's estimate or the engine's median per token with its
order-statistic interval. A candidate that cannot be chosen says why (`excluded`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from moesub.hardware import THIS_MACHINE
from moesub.vocabulary import ALL_RESIDENT, Policy

# config keys a policy may carry beside its `Policy` fields, with the value that means "off"
LAYOUT_DEFAULTS = {"pin": 0, "allocation": "uniform"}
HALVES = ("screen", "report")
DPPL = ("dppl_pct", "dppl_ci_lo", "dppl_ci_hi")


def non_default_fields(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of a config policy whose value is not the default (`Policy()`'s fields, and the
    layout keys against uniform allocation without pins): the tie rule's "simpler" is fewer."""
    defaults = Policy().to_dict() | LAYOUT_DEFAULTS
    return tuple(k for k, v in spec.items() if k not in defaults or v != defaults[k])


def lossless_on_every_stream(per_input_points: pd.DataFrame, fraction: float) -> dict[str, bool]:
    """policy -> whether its mean ΔNLL is exactly 0 on every stream (streams with a baseline)."""
    if per_input_points.empty:
        return {}
    s = per_input_points[
        (per_input_points["level"] == "stream")
        & np.isclose(per_input_points["fraction"], fraction)
        & (per_input_points["n_nll"] > 0)
    ]
    return {str(p): bool((g["dnll_mean"] == 0).all()) for p, g in s.groupby("policy")}


def _at(df: pd.DataFrame, fraction: float) -> pd.DataFrame:
    if df.empty or "fraction" not in df.columns:
        return df.iloc[:0]
    return df[np.isclose(df["fraction"].astype(float), fraction)]


def quality_candidates(
    tables: Mapping[str, pd.DataFrame],
    policies: Mapping[str, Mapping[str, Any]],
    fraction: float,
) -> pd.DataFrame:
    """One row per policy the analysis has at `fraction` (tables `summary`, `selection`,
    `design_space`, `per_input_points` of one model): `policy, family, non_default_fields,
    lossless, dppl_source, dppl_*` (all streams), `screen_dppl_*`, `report_dppl_*`, `hit_rate,
    misses_per_token, sub_rate, substituted_mass, bound, excluded`. `policies`: the config's,
    for the tie rule's fields."""
    summary, space = _at(tables["summary"], fraction), _at(tables["design_space"], fraction)
    names = sorted(set(summary.get("policy", [])) | set(space.get("policy", [])))
    quality = summary.reindex(
        columns=["policy", *DPPL, "hit_rate", "sub_rate", "sim_sub_rate", "sim_mass_mean"]
    ).set_index("policy")
    space = space.reindex(
        columns=["policy", "family", "bound", "lossless", "hit_rate", "misses_per_token"]
    ).set_index("policy")
    halves = _at(tables["selection"], fraction)
    every_stream = lossless_on_every_stream(tables["per_input_points"], fraction)
    rows = []
    for name in names:
        q = quality.loc[name] if name in quality.index else None
        s = space.loc[name] if name in space.index else None
        row: dict[str, Any] = {
            "policy": name,
            "family": None if s is None else s["family"],
            "non_default_fields": list(non_default_fields(policies.get(name, {}))),
            "bound": bool(s is not None and s["bound"]),
            "hit_rate": _first(
                None if s is None else s["hit_rate"], None if q is None else q["hit_rate"]
            ),
            "misses_per_token": None if s is None else _number(s["misses_per_token"]),
            # the simulator's (the replay of the evaluation streams), else emulate's
            "sub_rate": None if q is None else _first(q["sim_sub_rate"], q["sub_rate"]),
            # the simulator's mean substituted gate mass per token-layer (a trace model's
            # quality proxy, `moesub.recommend.trace`)
            "substituted_mass": None if q is None else _number(q["sim_mass_mean"]),
        }
        emulated = q is not None and _number(q["dppl_pct"]) is not None
        if emulated:
            row |= {k: _number(q[k]) for k in DPPL}
            row |= _halves(halves, name)
            row["lossless"] = every_stream.get(name, False)
            row["dppl_source"] = "emulated"
        elif s is not None and bool(s["lossless"]):  # Δppl 0 by construction, on any streams
            row |= dict.fromkeys(DPPL, 0.0)
            row |= {f"{h}_{k}": 0.0 for h in HALVES for k in DPPL}
            row |= {"lossless": True, "dppl_source": "exact"}
        else:
            row |= {"lossless": None, "dppl_source": None}
        row["excluded"] = _excluded(row)
        rows.append(row)
    return pd.DataFrame(rows, columns=QUALITY_COLUMNS)


QUALITY_COLUMNS = [
    "policy", "family", "non_default_fields", "bound", "hit_rate", "misses_per_token", "sub_rate",
    "substituted_mass", *DPPL, *(f"{h}_{k}" for h in HALVES for k in DPPL), "lossless",
    "dppl_source", "excluded",
]  # fmt: skip


def _halves(selection: pd.DataFrame, name: str) -> dict[str, Any]:
    """`screen_dppl_*`, `report_dppl_*` of one policy (None where the split is missing)."""
    out: dict[str, Any] = {}
    for half in HALVES:
        r = selection[(selection["policy"] == name) & (selection["half"] == half)]
        for k in DPPL:
            out[f"{half}_{k}"] = _number(r[k].iloc[0]) if len(r) and k in r.columns else None
    return out


def _excluded(r: Mapping[str, Any]) -> str | None:
    if r["policy"] == ALL_RESIDENT:
        return "every expert resident: not within this cache size's memory"
    if r["bound"]:
        return "an offline bound (Belady eviction needs the future): not a runnable policy"
    if r["dppl_source"] is None:
        return "no Δppl (not emulated, and not lossless by construction)"
    if r["screen_dppl_ci_hi"] is None:
        return "no Δppl interval on the screen half of the streams"
    return None


def _first(*values: Any) -> float | None:
    """The first of `values` that is a finite number."""
    return next((x for x in map(_number, values) if x is not None), None)


def _number(v: Any) -> float | None:
    """A finite float, else None (NaN, missing, non-numbers)."""
    if v is None or isinstance(v, (bool, str)):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


TIME_COLUMNS = [
    "policy", "fraction", "hardware", "time_source", "device", "time_per_token_s",
    "time_ci_lo", "time_ci_hi",
]  # fmt: skip


def time_rows(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Every time per token of one model (`TIME_COLUMNS`): the simulator's per simulated policy
    and hardware profile (`priced`: the policy's per-token-layer counts priced on the profile; no
    interval: the pricing is deterministic) and the engine's median per (policy, device) with
    its order-statistic interval on this machine (`speed_quality`, source engine)."""
    frames = []
    priced = tables["priced"]
    if not priced.empty:
        sim = priced[priced["source"] == "simulator"]
        frames.append(sim.assign(time_source="simulator", device=None, time_ci_lo=np.nan,
                                 time_ci_hi=np.nan))  # fmt: skip
    sq = tables["speed_quality"]
    if not sq.empty:
        eng = sq[sq["source"] == "engine"]
        frames.append(eng.assign(hardware=THIS_MACHINE, time_source="engine"))
    if not frames:
        return pd.DataFrame(columns=TIME_COLUMNS)
    rows = pd.concat([f.reindex(columns=TIME_COLUMNS) for f in frames], ignore_index=True)
    ok = np.isfinite(rows["time_per_token_s"].astype(float)) & (rows["time_per_token_s"] > 0)
    return rows[ok].reset_index(drop=True)
