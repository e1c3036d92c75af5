"""The recommendation: which policy to run, per model and cache fraction.

Read from the analysis outputs only (nothing is recomputed): per policy and fraction, Δppl % vs
the analysis baseline (`fetch_every_miss`) with its stream-bootstrap BCa interval and the hit
rate (`summary`), time per token and speedup vs the baseline (`speed_quality`), the per-stream
mean ΔNLL (`per_input_points`, level `stream`), the model's geometry (`models`) and, for a
model given as a trace (no Δppl, no engine), the priced simulator runs (`priced`).

Two choices per fraction, each the *fastest* candidate that qualifies:
- `within_budget`: the upper CI bound of its Δppl is <= `dppl_budget_pct` (the boundary counts);
- `lossless`: its Δppl is exactly 0 on every stream (e.g. the fetch rules).
A candidate's time is the engine's (median per token, on the summary's engine device: a CUDA one
if any ran) where the engine ran it, else the simulator's estimate. "Fastest" ranks by speedup vs
the baseline, each taken against the baseline in the same source (engine on the same device, or
simulator): the simulator's absolute times are off the engine's, its ratios much less, so a
simulated policy is not picked only for being priced by the simulator. Ties: the smaller Δppl
upper bound, then the name. No qualifying candidate: the choice is null with the reason.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pandas as pd

from moesub.config import ALL_RESIDENT, schema_defaults
from moesub.hardware import STUDY_PROFILE
from moesub.io import write_json
from moesub.vocabulary import capacity_for

_DEFAULTS = schema_defaults("recommend")  # workflow/schemas/config.schema.yaml
# the analysis outputs read (the analysis rule's named outputs; `analysis` is analysis.json)
INPUTS = ("analysis", "summary", "speed_quality", "per_input_points", "models", "priced")


@dataclass(frozen=True)
class RecommendParams:
    """`dppl_budget_pct`: the largest upper CI bound of Δppl % a within-budget choice may have."""

    dppl_budget_pct: float = _DEFAULTS["dppl_budget_pct"]

    def __post_init__(self) -> None:
        b = self.dppl_budget_pct
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
            raise ValueError(f"recommend.dppl_budget_pct: must be a number > 0, got {b!r}")

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> RecommendParams:
        unknown = set(params) - {"dppl_budget_pct"}
        if unknown:
            raise ValueError(f"recommend: unknown key(s) {sorted(unknown)}")
        return cls(**params)


# ---- candidates ------------------------------------------------------------------------------


def lossless_policies(per_input_points: pd.DataFrame, fraction: float) -> dict[str, bool]:
    """policy -> whether its mean ΔNLL is exactly 0 on every stream (streams with a baseline)."""
    if per_input_points.empty:
        return {}
    s = per_input_points[
        (per_input_points["level"] == "stream")
        & np.isclose(per_input_points["fraction"], fraction)
        & (per_input_points["n_nll"] > 0)
    ]
    return {str(p): bool((g["dnll_mean"] == 0).all()) for p, g in s.groupby("policy")}


def timing_rows(
    summary: pd.DataFrame, speed_quality: pd.DataFrame, fraction: float
) -> pd.DataFrame:
    """One time per policy at `fraction`: the engine's where the summary has an engine speedup
    (its device: the analysis picks a CUDA one if any ran), else the simulator's; columns
    policy, time_source, device, time_per_token_s, speedup_vs_fetch_every_miss."""
    cols = ["policy", "time_source", "device", "time_per_token_s", "speedup_vs_fetch_every_miss"]
    frames = []
    if "engine_device" in summary.columns:
        eng = summary[np.isclose(summary["fraction"], fraction)]
        frames.append(eng.assign(time_source="engine", device=eng["engine_device"]))
    if not speed_quality.empty:
        sim = speed_quality[
            np.isclose(speed_quality["fraction"], fraction)
            & (speed_quality["source"] == "simulate")
        ]
        frames.append(sim.assign(time_source="simulator", device=None))
    if not frames:
        return pd.DataFrame(columns=cols)
    both = pd.concat([f[cols] for f in frames], ignore_index=True)  # engine rows first
    both = both[np.isfinite(both["speedup_vs_fetch_every_miss"].astype(float))]
    return both.drop_duplicates("policy").reset_index(drop=True)


def candidates(
    summary: pd.DataFrame,
    speed_quality: pd.DataFrame,
    per_input_points: pd.DataFrame,
    fraction: float,
    calls_per_token: int,
) -> pd.DataFrame:
    """Every policy the analysis has at `fraction` (the model's rows only), with its figures and
    `excluded` (why it cannot be chosen, None if it can). `calls_per_token`: k * L."""
    keys = ["policy", "fraction", "dppl_pct", "dppl_ci_lo", "dppl_ci_hi", "hit_rate"]
    # a part the analysis could not run leaves its columns out: those figures are then missing
    s = summary.reindex(columns=list(dict.fromkeys([*keys, *summary.columns])))
    s = s[np.isclose(s["fraction"].astype(float), fraction)]
    c = s[[k for k in keys if k != "fraction"]].merge(
        timing_rows(s, speed_quality, fraction), on="policy", how="left"
    )
    c["misses_per_token"] = (1.0 - c["hit_rate"].astype(float)) * calls_per_token
    lossless = lossless_policies(per_input_points, fraction)
    c["lossless"] = [lossless.get(p) for p in c["policy"]]
    c["excluded"] = [excluded_because(r) for r in c.to_dict("records")]
    return c.sort_values("policy", ignore_index=True)


def excluded_because(r: Mapping[str, Any]) -> str | None:
    if r["policy"] == ALL_RESIDENT:
        return "every expert resident: not within this fraction's memory"
    if not _finite(r["dppl_ci_hi"]):
        return "no Δppl interval (not emulated, or no baseline)"
    if not _finite(r["speedup_vs_fetch_every_miss"]):
        return "no time per token vs the baseline (neither engine nor simulator)"
    return None


def _finite(v: Any) -> bool:
    return v is not None and not isinstance(v, str) and bool(np.isfinite(float(v)))


# ---- the choice ------------------------------------------------------------------------------


def choose(cands: pd.DataFrame, budget_pct: float) -> dict[str, tuple[dict | None, str | None]]:
    """{"within_budget": (row, None) | (None, reason), "lossless": ...} from `candidates`."""
    ok = cands[cands["excluded"].isna()]
    ok = ok.assign(_neg_speedup=-ok["speedup_vs_fetch_every_miss"].astype(float))
    ok = ok.sort_values(["_neg_speedup", "dppl_ci_hi", "policy"]).drop(columns="_neg_speedup")
    if ok.empty:
        reasons = sorted({str(e) for e in cands["excluded"].dropna()})
        why = "no candidate: " + ("; ".join(reasons) if reasons else "no policy at this fraction")
        return {"within_budget": (None, why), "lossless": (None, why)}
    out: dict[str, tuple[dict | None, str | None]] = {}
    within = ok[ok["dppl_ci_hi"].astype(float) <= budget_pct]
    lowest = ok.sort_values(["dppl_ci_hi", "policy"]).iloc[0]
    out["within_budget"] = (
        (within.iloc[0].to_dict(), None)
        if not within.empty
        else (
            None,
            f"no candidate's Δppl upper CI bound is <= {budget_pct:g}% (lowest: "
            f"{lowest['policy']} at {float(lowest['dppl_ci_hi']):.3g}%)",
        )
    )
    exact = ok[ok["lossless"].eq(True)]
    out["lossless"] = (
        (exact.iloc[0].to_dict(), None)
        if not exact.empty
        else (None, "no candidate has Δppl exactly 0 on every stream")
    )
    return out


FIGURES = (
    "policy",
    "time_per_token_s",
    "time_source",
    "device",
    "speedup_vs_fetch_every_miss",
    "dppl_pct",
    "dppl_ci_lo",
    "dppl_ci_hi",
    "lossless",
    "hit_rate",
    "misses_per_token",
)


def _plain(row: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """JSON values: NaN -> None, numpy scalars -> Python."""
    out = {}
    for k in keys:
        v = row.get(k)
        if isinstance(v, (np.generic,)):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


# ---- the document ----------------------------------------------------------------------------


def _read_inputs(inputs: Mapping[str, str | os.PathLike]) -> dict[str, Any]:
    missing_keys = [k for k in INPUTS if k not in inputs]
    if missing_keys:
        raise ValueError(f"recommend: inputs lack {missing_keys} (the analysis outputs {INPUTS})")
    for k in INPUTS:
        if not Path(inputs[k]).is_file():
            raise FileNotFoundError(f"recommend: inputs[{k!r}] = {str(inputs[k])!r} is missing")
    out: dict[str, Any] = {"analysis": json.loads(Path(inputs["analysis"]).read_text())}
    for k in INPUTS[1:]:
        out[k] = pd.read_parquet(inputs[k])
    return out


def recommend(
    inputs: Mapping[str, str | os.PathLike], model: str, params: Mapping[str, Any]
) -> dict[str, Any]:
    """The recommendation document of `model` (see `RECOMMENDATION_SCHEMA`) from the analysis
    outputs `inputs` (keys `INPUTS`); `params`: config `recommend` (`RecommendParams`)."""
    p = RecommendParams.from_mapping(params)
    t = _read_inputs(inputs)
    doc_params = t["analysis"].get("params") or {}
    models = t["models"]
    if models.empty or model not in set(models["model"]):
        raise ValueError(f"recommend: model {model!r} is not in the analysis' models table")
    m = models[models["model"] == model].iloc[0]
    geometry = {"num_experts": int(m["num_experts"]), "top_k": int(m["top_k"])}
    geometry["num_layers"] = int(m["num_layers"])

    def of_model(df: pd.DataFrame) -> pd.DataFrame:
        return df[df["model"] == model] if not df.empty else df

    summary, sq, pip, priced = (
        of_model(t[k]) for k in ("summary", "speed_quality", "per_input_points", "priced")
    )
    fractions = sorted({float(f) for f in m["fractions"]} | set(summary.get("fraction", [])))
    if m.get("source") == "trace":
        return trace_recommendation(model, geometry, summary, priced, fractions, t["analysis"], p)
    entries = []
    for f in fractions:
        cands = candidates(summary, sq, pip, f, geometry["top_k"] * geometry["num_layers"])
        entry: dict[str, Any] = {
            "fraction": f,
            "capacity": capacity_for(f, geometry["num_experts"]),
        }
        for kind, (row, reason) in choose(cands, p.dppl_budget_pct).items():
            entry[kind] = _plain(row, FIGURES) if row is not None else None
            entry[f"{kind}_reason"] = reason
        entry["candidates"] = [_plain(r, (*FIGURES, "excluded")) for r in cands.to_dict("records")]
        entries.append(entry)
    doc = {
        "model": model,
        **geometry,
        "baseline": doc_params.get("baseline", "fetch_every_miss"),
        "ci_level": doc_params.get("ci_level"),
        "dppl_budget_pct": p.dppl_budget_pct,
        "fractions": entries,
    }
    jsonschema.validate(doc, RECOMMENDATION_SCHEMA)
    return doc


# ---- a trace model: no Δppl, the substituted mass as its proxy ------------------------------


def mass_proxy(analysis: Mapping[str, Any], model: str, fraction: float) -> dict[str, Any]:
    """How well substituted mass stood for Δppl where Δppl was measured: the mass hypothesis'
    r of the other models (`analysis.json["mass_hypothesis"]`), the one at the nearest fraction
    with an r first."""
    entries = [e for e in analysis.get("mass_hypothesis") or [] if e.get("model", model) != model]
    entries.sort(key=lambda e: (e.get("r") is None, abs(float(e["fraction"]) - fraction)))
    out: dict[str, Any] = {
        "measure": "mean substituted gate mass per token-layer (simulated)",
        "label": "quality proxy: substituted mass, not a measured Δppl",
    }
    if not entries:
        return {**out, "r": None, "reason": "no model with measured Δppl in this analysis"}
    e = entries[0]
    return {
        **out,
        "r": e.get("r"),
        "from_model": e.get("model"),
        "from_fraction": float(e["fraction"]),
        "n_policies": e.get("n"),
        "reason": e.get("reason"),
    }


def trace_hardware(priced: pd.DataFrame) -> str | None:
    """The profile a trace model's times are priced on: the study's where it was priced, else
    the first by name (a trace model has no this_machine: no engine); None if none was."""
    sim = priced[priced["source"] == "simulator"] if not priced.empty else priced
    names = sorted(set(sim.get("hardware", [])))
    if not names:
        return None
    return STUDY_PROFILE if STUDY_PROFILE in names else names[0]


def trace_candidates(
    summary: pd.DataFrame,
    priced: pd.DataFrame,
    hardware: str | None,
    fraction: float,
    baseline: str,
    calls_per_token: int,
) -> pd.DataFrame:
    """A trace model's policies at `fraction`: hit rate and substituted mass (the summary's
    simulate columns), the simulator's tokens priced on `hardware` (`priced`: the analysis'
    priced runs) and the speedup vs `baseline`'s."""
    cols = ["policy", "sim_hit_rate", "sim_sub_rate", "sim_mass_mean"]
    s = summary.reindex(columns=list(dict.fromkeys([*cols, "fraction", *summary.columns])))
    c = s[np.isclose(s["fraction"].astype(float), fraction)][cols].rename(
        columns={"sim_hit_rate": "hit_rate", "sim_mass_mean": "substituted_mass"}
    )
    times = (
        priced[
            (priced["hardware"] == hardware)
            & (priced["source"] == "simulator")
            & np.isclose(priced["fraction"].astype(float), fraction)
        ][["policy", "time_per_token_s"]]
        if hardware is not None
        else pd.DataFrame(columns=["policy", "time_per_token_s"])
    )
    c = c.merge(times, on="policy", how="left")
    base = c.loc[c["policy"] == baseline, "time_per_token_s"].astype(float)
    c["speedup_vs_fetch_every_miss"] = (
        float(base.iloc[0]) / c["time_per_token_s"].astype(float) if len(base) else math.nan
    )
    c["time_source"], c["device"] = "simulator", None
    c["misses_per_token"] = (1.0 - c["hit_rate"].astype(float)) * calls_per_token
    # no substitution: every selected expert computed exactly, lossless without measuring Δppl
    c["lossless"] = c["sim_sub_rate"].astype(float) == 0
    c["excluded"] = [
        f"no time per token vs the baseline (simulator priced on {hardware})"
        if not _finite(r["speedup_vs_fetch_every_miss"])
        else None
        for r in c.to_dict("records")
    ]
    return c.drop(columns="sim_sub_rate").sort_values("policy", ignore_index=True)


# a choice's figures (Δppl null: none measured) and the substituted mass, the quality proxy
TRACE_FIGURES = (*FIGURES, "substituted_mass")


def trace_recommendation(
    model: str,
    geometry: dict[str, int],
    summary: pd.DataFrame,
    priced: pd.DataFrame,
    fractions: list[float],
    analysis: Mapping[str, Any],
    p: RecommendParams,
) -> dict[str, Any]:
    """A trace model's recommendation: per fraction the fastest policy (its substituted mass as
    the quality proxy, labelled so) and the fastest lossless one (no substitution), priced on
    one hardware profile (`trace_hardware`; the document's `hardware` names it)."""
    baseline = (analysis.get("params") or {}).get("baseline", "fetch_every_miss")
    hardware = trace_hardware(priced)
    calls = geometry["top_k"] * geometry["num_layers"]
    entries = []
    for f in fractions:
        cands = trace_candidates(summary, priced, hardware, f, baseline, calls)
        ok = cands[cands["excluded"].isna()].sort_values(
            ["speedup_vs_fetch_every_miss", "substituted_mass", "policy"],
            ascending=[False, True, True],
        )
        lossless = ok[ok["lossless"]]
        entry: dict[str, Any] = {
            "fraction": f,
            "capacity": capacity_for(f, geometry["num_experts"]),
            "within_budget": None,
            "within_budget_reason": "a trace model has no measured Δppl (no weights); see "
            "fastest and its substituted mass, the quality proxy",
            "fastest": _plain(ok.iloc[0], TRACE_FIGURES) if len(ok) else None,
            "lossless": _plain(lossless.iloc[0], TRACE_FIGURES) if len(lossless) else None,
            "lossless_reason": None if len(lossless) else "no simulated policy substitutes nothing",
            "quality_proxy": mass_proxy(analysis, model, f),
            "candidates": [
                _plain(r, (*TRACE_FIGURES, "excluded")) for r in cands.to_dict("records")
            ],
        }
        entries.append(entry)
    doc = {
        "model": model,
        "source": "trace",
        "hardware": hardware,
        **geometry,
        "baseline": baseline,
        "ci_level": (analysis.get("params") or {}).get("ci_level"),
        "dppl_budget_pct": p.dppl_budget_pct,
        "fractions": entries,
    }
    jsonschema.validate(doc, RECOMMENDATION_SCHEMA)
    return doc


def write_recommendation(
    inputs: Mapping[str, str | os.PathLike],
    model: str,
    params: Mapping[str, Any],
    out_path: str | os.PathLike,
) -> dict[str, Any]:
    """`recommend(...)` written atomically to `out_path` (results/{model}/recommendation.json)."""
    doc = recommend(inputs, model, params)
    write_json(doc, out_path)
    return doc


_NUM = {"type": ["number", "null"]}
_FIGURES_SCHEMA = {
    "type": "object",
    "required": list(FIGURES),
    "properties": {
        "policy": {"type": "string"},
        "time_per_token_s": _NUM,
        "time_source": {"enum": ["engine", "simulator", None]},
        "device": {"type": ["string", "null"]},
        "speedup_vs_fetch_every_miss": _NUM,
        "dppl_pct": _NUM,
        "dppl_ci_lo": _NUM,
        "dppl_ci_hi": _NUM,
        "lossless": {"type": ["boolean", "null"]},
        "hit_rate": _NUM,
        "misses_per_token": _NUM,
        "substituted_mass": _NUM,
        "excluded": {"type": ["string", "null"]},
    },
}
_CHOICE = {"oneOf": [{"type": "null"}, _FIGURES_SCHEMA]}
_REASON = {"type": ["string", "null"]}
RECOMMENDATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "baseline", "ci_level", "dppl_budget_pct", "fractions"],
    "properties": {
        "model": {"type": "string"},
        "num_experts": {"type": "integer"},
        "top_k": {"type": "integer"},
        "num_layers": {"type": "integer"},
        "baseline": {"type": "string"},
        "ci_level": _NUM,
        "hardware": {"type": ["string", "null"]},
        "dppl_budget_pct": {"type": "number", "exclusiveMinimum": 0},
        "fractions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "fraction",
                    "capacity",
                    "within_budget",
                    "within_budget_reason",
                    "lossless",
                    "lossless_reason",
                    "candidates",
                ],
                "properties": {
                    "fraction": {"type": "number"},
                    "capacity": {"type": "integer"},
                    "within_budget": _CHOICE,
                    "within_budget_reason": _REASON,
                    "lossless": _CHOICE,
                    "lossless_reason": _REASON,
                    "candidates": {"type": "array", "items": _FIGURES_SCHEMA},
                },
            },
        },
    },
}
