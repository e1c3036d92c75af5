"""The recommendation document of one model (`recommend`, `RECOMMENDATION_SCHEMA`).

Per ranking (hardware, cache size, time source: `moesub.recommend.ranking`) two choices, each
with its figures: the policy, its per-layer slots and pins, time and tokens per second with
their interval, speedups vs `fetch_every_miss` and vs `host_compute` (the llama.cpp-style
baseline) in the same ranking, hit rate and misses per token, and Δppl % three ways: on the
screen half of the streams (what it was chosen on), on the report half (the streams it was not
chosen on: the figure to quote) and on all streams (labelled). Every candidate is listed with
why it could not be chosen, if so. A model given as a router trace has no Δppl: its rankings
hold `fastest` with the substituted mass as the labelled quality proxy instead of a
within-budget choice (`moesub.recommend.trace`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pandas as pd

from moesub.config import schema_defaults
from moesub.hardware import THIS_MACHINE, read_unit_costs
from moesub.io import write_json
from moesub.recommend.candidates import HALVES, quality_candidates, time_rows
from moesub.recommend.ranking import (
    ENGINE_TIMING,
    Choice,
    choose,
    profile_timing,
    simulator_timing,
    speedups,
    with_intervals,
)
from moesub.recommend.study import STUDY_SPEEDUPS, study_comparison
from moesub.recommend.trace import mass_proxy, trace_choices
from moesub.vocabulary import capacity_for

_DEFAULTS = schema_defaults("recommend")  # workflow/schemas/config.schema.yaml
# the analysis outputs read (the analysis rule's named outputs; `analysis` is analysis.json)
INPUTS = (
    "analysis", "summary", "selection", "design_space", "speed_quality", "per_input_points",
    "priced", "engine_bench", "models",
)  # fmt: skip
TIE_RULE = (
    "candidates whose time intervals overlap the fastest qualifying one's are tied; the tie goes "
    "to the simpler policy (fewer fields away from their defaults: rule fetch_all, eviction lru, "
    "no admission, prefetch, route bias, host-computed light misses, co-activation substitutes, "
    "pins, host uploads or planned allocation), then the faster, then the name"
)


@dataclass(frozen=True)
class RecommendParams:
    """`dppl_budget_pct`: the largest upper CI bound of Δppl % (on the screen half of the
    streams) a within-budget choice may have."""

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


FIGURES = (
    "policy", "family", "non_default_fields", "time_per_token_s", "time_lo_s", "time_hi_s",
    "tokens_per_s", "speedup_vs_fetch_every_miss", "speedup_vs_fetch_every_miss_lo",
    "speedup_vs_fetch_every_miss_hi", "speedup_vs_host_compute", "speedup_vs_host_compute_lo",
    "speedup_vs_host_compute_hi", "hit_rate", "misses_per_token", "sub_rate", "substituted_mass",
    "lossless",
    "dppl_source",
    "dppl_pct", "dppl_ci_lo", "dppl_ci_hi", "screen_dppl_pct", "screen_dppl_ci_lo",
    "screen_dppl_ci_hi", "report_dppl_pct", "report_dppl_ci_lo", "report_dppl_ci_hi",
)  # fmt: skip


def _plain(row: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """JSON values: NaN -> None, numpy scalars -> Python, lists kept."""
    out = {}
    for k in keys:
        v = row.get(k)
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


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


def _of_model(df: pd.DataFrame, model: str) -> pd.DataFrame:
    return df[df["model"] == model] if not df.empty and "model" in df.columns else df


@dataclass(frozen=True)
class ModelFacts:
    """What a ranking needs of its model: E, k, L, its cache sizes (fraction -> size label and
    slots per layer C) and the layout each simulated policy ran with ((policy, fraction) ->
    per-layer capacities and pins; absent: uniform C without pins)."""

    num_experts: int
    top_k: int
    num_layers: int
    sizes: Mapping[float, tuple[str, int]]
    layouts: Mapping[tuple[str, float], tuple[list[int], list[int]]]

    def size(self, fraction: float) -> tuple[str, int]:
        for f, size in self.sizes.items():
            if math.isclose(f, fraction):
                return size
        return f"f{fraction:g}", capacity_for(fraction, self.num_experts)

    def layout(self, policy: str, fraction: float) -> tuple[list[int], list[int]]:
        for (name, f), layout in self.layouts.items():
            if name == policy and math.isclose(f, fraction):
                return layout
        return [self.size(fraction)[1]] * self.num_layers, [0] * self.num_layers


def model_facts(row: Mapping[str, Any], provenance: list[Mapping[str, Any]]) -> ModelFacts:
    """`ModelFacts` from the model's row of `models.parquet` (its fractions, and where the
    analysis has them its size labels and capacities) and the simulate files' metadata in
    `analysis.json["provenance"]` (their `layout`)."""
    E, k, L = (int(row[c]) for c in ("num_experts", "top_k", "num_layers"))
    fractions = [float(f) for f in _listed(row.get("fractions"))]
    labels = _listed(row.get("sizes")) or [f"f{f:g}" for f in fractions]
    caps = _listed(row.get("capacities")) or [capacity_for(f, E) for f in fractions]
    sizes = {f: (str(lab), int(c)) for f, lab, c in zip(fractions, labels, caps, strict=True)}
    layouts = {}
    for e in provenance:
        meta = e.get("metadata") or {}
        layout = meta.get("layout")
        if e.get("kind") == "simulate" and layout and meta.get("fraction") is not None:
            key = (str(meta.get("name")), float(meta["fraction"]))
            layouts[key] = (
                [int(c) for c in layout["capacities"]],
                [int(p) for p in layout["pins"]],
            )
    return ModelFacts(E, k, L, sizes, layouts)


def _listed(v: Any) -> list[Any]:
    """A list cell of a table (a list, an array, or missing) as a list."""
    return [] if v is None or (isinstance(v, float) and math.isnan(v)) else list(v)


def _choice(
    c: Choice, policies: Mapping[str, Mapping[str, Any]], facts: ModelFacts, fraction: float
) -> dict[str, Any] | None:
    if c.row is None:
        return None
    out = _plain(c.row, FIGURES)
    out["fields"] = dict(policies.get(c.row["policy"]) or {})  # the config's policy
    out["slots_per_layer"], out["pins_per_layer"] = facts.layout(c.row["policy"], fraction)
    out["fastest"] = c.fastest
    out["tied"] = list(c.tied)
    return out


def rankings(
    tables: Mapping[str, pd.DataFrame],
    policies: Mapping[str, Mapping[str, Any]],
    facts: ModelFacts,
    baselines: tuple[str, str],
    budget_pct: float,
    quality_proxy: Callable[[float], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every ranking of one model's tables (module doc): one per (hardware, time source,
    device, cache fraction) that has times, each with its choices and candidates.
    `quality_proxy` (a trace model: no Δppl): fraction -> the proxy's description; the
    rankings then hold `fastest` and `quality_proxy`, and no within-budget choice
    (`moesub.recommend.trace`)."""
    times = time_rows(tables)
    sim_timing = simulator_timing(tables["engine_bench"])
    pricing_timing = simulator_timing(tables["engine_bench"], "sim_rel_error_at_run_disk")
    base, host = baselines
    out = []
    keys = ["hardware", "time_source", "device", "fraction"]
    for (hardware, source, device, fraction), g in times.groupby(keys, dropna=False, sort=True):
        timing = (
            ENGINE_TIMING
            if source == "engine"
            else sim_timing
            if hardware == THIS_MACHINE
            else profile_timing(pricing_timing, hardware)
        )
        cands = quality_candidates(tables, policies, float(fraction))
        ranked = cands.merge(with_intervals(g, timing), on="policy", how="left")
        no_time = ranked["time_per_token_s"].isna() & ranked["excluded"].isna()
        ranked.loc[no_time, "excluded"] = f"no {source} time per token at this size"
        ranked = speedups(ranked, base, "speedup_vs_fetch_every_miss")
        ranked = speedups(ranked, host, "speedup_vs_host_compute")
        ranked["tokens_per_s"] = 1.0 / ranked["time_per_token_s"]
        label, capacity = facts.size(float(fraction))
        entry: dict[str, Any] = {
            "hardware": hardware,
            "time_source": source,
            "device": None if pd.isna(device) else str(device),
            "size": label,
            "fraction": float(fraction),
            "capacity": capacity,
            "timing": timing.to_dict(),
        }
        choices = choose(ranked, budget_pct)
        if quality_proxy is not None:
            choices = trace_choices(ranked, choices)
            entry["quality_proxy"] = quality_proxy(float(fraction))
        for kind, c in choices.items():
            entry[kind] = _choice(c, policies, facts, float(fraction))
            entry[f"{kind}_reason"] = c.reason
        entry["candidates"] = [
            _plain(r, (*FIGURES, "excluded"))
            for r in ranked.sort_values(["time_per_token_s", "policy"]).to_dict("records")
        ]
        out.append(entry)
    return out


def _selection(analysis: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """The analysis' split of the model's streams (`moesub.stats.selection`), or None."""
    for s in analysis.get("selection") or []:
        if s.get("model") == model:
            return {k: v for k, v in s.items() if k != "model"}
    return None


def recommend(
    inputs: Mapping[str, str | os.PathLike], model: str, params: Mapping[str, Any]
) -> dict[str, Any]:
    """The recommendation document of `model` (see `RECOMMENDATION_SCHEMA`) from the analysis
    outputs `inputs` (keys `INPUTS`, and `study_profile`: the study's hardware profile priced
    for this model, `results/{model}/hardware/<STUDY_PROFILE>.json`, where this run prices it);
    `params`: config `recommend` (`RecommendParams`)."""
    p = RecommendParams.from_mapping(params)
    t = _read_inputs(inputs)
    a_params = t["analysis"].get("params") or {}
    models = t["models"]
    if models.empty or model not in set(models["model"]):
        raise ValueError(f"recommend: model {model!r} is not in the analysis' models table")
    m = models[models["model"] == model].iloc[0]
    provenance = [e for e in t["analysis"].get("provenance") or [] if e.get("model") == model]
    facts = model_facts(m.to_dict(), provenance)
    tables = {k: _of_model(t[k], model) for k in INPUTS[1:] if k != "engine_bench"}
    tables["engine_bench"] = t["engine_bench"]  # shared by every model
    baselines = (
        a_params.get("baseline", "fetch_every_miss"),
        a_params.get("host_baseline", "host_compute"),
    )
    trace = m.get("source") == "trace"  # a model given as a router trace (module trace)
    doc = {
        "model": model,
        "source": m.get("source"),
        "num_experts": facts.num_experts,
        "top_k": facts.top_k,
        "num_layers": facts.num_layers,
        "baseline": baselines[0],
        "host_baseline": baselines[1],
        "ci_level": a_params.get("ci_level"),
        "dppl_budget_pct": p.dppl_budget_pct,
        "selection": _selection(t["analysis"], model),
        "tie_rule": TIE_RULE,
    }
    doc["rankings"] = rankings(
        tables,
        a_params.get("policies") or {},
        facts,
        baselines,
        p.dppl_budget_pct,
        (lambda f: mass_proxy(t["analysis"], model, f)) if trace else None,
    )
    # the study profile's seconds for this model, where this run priced it
    study = inputs.get("study_profile")
    costs = read_unit_costs(study)[1] if study else None
    doc["study"] = study_comparison(doc["rankings"], costs, facts.top_k)
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
_STR = {"type": ["string", "null"]}
_NAMES = {"type": "array", "items": {"type": "string"}}
_FIGURES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": list(FIGURES),
    "properties": {
        **{k: _NUM for k in FIGURES},
        "policy": {"type": "string"},
        "family": _STR,
        "non_default_fields": _NAMES,
        "lossless": {"type": ["boolean", "null"]},
        "dppl_source": {"enum": ["emulated", "exact", None]},
        "excluded": _STR,
    },
}
_COUNTS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_CHOICE = {
    "oneOf": [
        {"type": "null"},
        {
            **_FIGURES_SCHEMA,
            "required": [
                *FIGURES,
                "fields",
                "slots_per_layer",
                "pins_per_layer",
                "fastest",
                "tied",
            ],  # fmt: skip
            "properties": {
                **_FIGURES_SCHEMA["properties"],
                "fields": {"type": "object"},
                "slots_per_layer": _COUNTS,
                "pins_per_layer": _COUNTS,
                "fastest": {"type": "string"},
                "tied": _NAMES,
            },
        },
    ]
}
_RANKING = {
    "type": "object",
    "required": [
        "hardware",
        "time_source",
        "device",
        "size",
        "fraction",
        "capacity",
        "timing",
        "within_budget",
        "within_budget_reason",
        "lossless",
        "lossless_reason",
        "candidates",
    ],  # fmt: skip
    "properties": {
        "hardware": {"type": "string"},
        "time_source": {"enum": ["engine", "simulator"]},
        "device": _STR,
        "size": {"type": "string"},
        "fraction": {"type": "number"},
        "capacity": {"type": "integer"},
        "timing": {
            "type": "object",
            "required": ["method", "text"],
            "properties": {"method": {"type": "string"}, "text": {"type": "string"}},
        },
        "within_budget": _CHOICE,
        "within_budget_reason": _STR,
        "lossless": _CHOICE,
        "lossless_reason": _STR,
        "candidates": {"type": "array", "items": _FIGURES_SCHEMA},
        # a trace model's (moesub.recommend.trace)
        "fastest": _CHOICE,
        "fastest_reason": _STR,
        "quality_proxy": {
            "type": "object",
            "required": ["measure", "label", "r", "reason"],
            "properties": {"label": {"type": "string"}, "r": _NUM, "reason": _STR},
        },
    },
}
RECOMMENDATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "model",
        "num_experts",
        "top_k",
        "num_layers",
        "baseline",
        "host_baseline",
        "ci_level",
        "dppl_budget_pct",
        "selection",
        "tie_rule",
        "rankings",
    ],  # fmt: skip
    "properties": {
        "model": {"type": "string"},
        "source": {"enum": ["embedded", "checkpoint", "trace", None]},
        "num_experts": {"type": "integer"},
        "top_k": {"type": "integer"},
        "num_layers": {"type": "integer"},
        "baseline": {"type": "string"},
        "host_baseline": {"type": "string"},
        "ci_level": _NUM,
        "dppl_budget_pct": {"type": "number", "exclusiveMinimum": 0},
        "selection": {
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["seed", "method", *(f"{h}_streams" for h in HALVES)],
                    "properties": {f"{h}_streams": _COUNTS for h in HALVES},
                },
            ]
        },
        "tie_rule": {"type": "string"},
        "rankings": {"type": "array", "items": _RANKING},
        "study": {
            "type": "object",
            "required": ["hardware", "fraction", "priced", "comparisons", "miss_rate", "sub_rate"],
            "properties": {
                "priced": {"type": "boolean"},
                "comparisons": {
                    "type": "array",
                    "minItems": len(STUDY_SPEEDUPS),
                    "items": {
                        "type": "object",
                        "required": ["policy", "reference", "study_low", "study_high", "speedup"],
                        "properties": {"speedup": _NUM, "speedup_lo": _NUM, "speedup_hi": _NUM},
                    },
                },
                "miss_rate": _NUM,
                "sub_rate": _NUM,
            },
        },
    },
}
