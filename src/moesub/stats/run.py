"""`run_analysis`: every part, per model, then the output files.

The parts run in `PARTS` order on one `Context` per model; each reads what the earlier ones
left in `ctx.tables` (e.g. `emu_streams` from quality) and fills its own outputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from moesub.io import write_json
from moesub.stats.admission import admission_part
from moesub.stats.design import design_space_part
from moesub.stats.expb import expb_part
from moesub.stats.generation import generation_part
from moesub.stats.intervals import level_label
from moesub.stats.load import (
    Context,
    check_inputs,
    missing,
    none_if_nan,
    split_by_model,
    write_table,
)
from moesub.stats.mass import mass_hypothesis_part, per_input_part
from moesub.stats.params import AnalysisParams
from moesub.stats.quality import quality_part
from moesub.stats.regime import regime_part
from moesub.stats.timing import engine_bench, engine_part, simulate_part

OUTPUT_FILES = (
    "models",
    "summary",
    "mass_points",
    "per_input",
    "per_input_points",
    "expb",
    "expb_streams",
    "admission",
    "speed_quality",
    "sim_vs_engine",
    "layer_hit_rates",
    "engine_bench",
    "generation",
    "regime",
    "design_space",
    "design_families",
)


def summary_part(ctx: Context) -> None:
    keys = []
    for t in ("quality", "sim_total", "engine"):
        df = ctx.tables[t]
        if not df.empty:
            keys.append(df[["policy", "fraction"]])
    gen = ctx.tables["generation"]
    if not gen.empty:
        keys.append(gen[["policy", "fraction"]])
    if not keys:
        ctx.tables["summary"] = pd.DataFrame()
        ctx.parts["summary"] = missing("no per-policy artefacts at all")
        return
    s = pd.concat(keys).drop_duplicates().sort_values(["fraction", "policy"])
    s = s.reset_index(drop=True)
    pols = [ctx.policy(n) or {} for n in s["policy"]]
    for key in ("rule", "tau", "eviction", "beta"):
        s[key] = [p.get(key) for p in pols]
    if not ctx.tables["quality"].empty:
        s = s.merge(ctx.tables["quality"], on=["policy", "fraction"], how="left")
    sim = ctx.tables["sim_total"]
    if not sim.empty:
        s = s.merge(
            sim[["policy", "fraction", "hit_rate", "sub_rate", "est_time_per_token_s"]].rename(
                columns={
                    "hit_rate": "sim_hit_rate",
                    "sub_rate": "sim_sub_rate",
                    "est_time_per_token_s": "sim_time_per_token_s",
                }
            ),
            on=["policy", "fraction"],
            how="left",
        )
    eng = ctx.tables["engine"]
    if not eng.empty:
        # one device per summary row: a CUDA device if one ran, else the first by name
        order = eng.assign(_cuda=~eng["device"].astype(str).str.startswith("cuda"))
        first = order.sort_values(["_cuda", "device"]).drop_duplicates(["policy", "fraction"])
        s = s.merge(
            first[
                [
                    "policy",
                    "fraction",
                    "device",
                    "time_per_token_s",
                    "speedup_vs_fetch_every_miss",
                    "speedup_vs_host_compute",
                ]
            ].rename(columns={"device": "engine_device"}),
            on=["policy", "fraction"],
            how="left",
        )
    if not gen.empty:
        for task in sorted(gen["task"].unique()):
            cols = ("accuracy", "ci_low", "ci_high", "n", "agreement")
            g = gen[gen["task"] == task][["policy", "fraction", *cols]].rename(
                columns={c: f"{task}_{c}" for c in cols}
            )
            s = s.merge(g, on=["policy", "fraction"], how="left")
    ctx.tables["summary"] = s
    ctx.parts["summary"] = {"status": "ok"}


# ---- output --------------------------------------------------------------------------------


PARTS: tuple[Callable[[Context], None], ...] = (
    quality_part,
    mass_hypothesis_part,
    per_input_part,
    expb_part,
    admission_part,
    simulate_part,
    design_space_part,
    engine_part,
    generation_part,
    regime_part,
    summary_part,
)


def analyse_model(inputs: dict[str, list[str]], params: AnalysisParams) -> Context:
    """Every part on one model's artefacts."""
    ctx = Context(inputs, params)
    ctx.load_tables()
    for part in PARTS:
        part(ctx)
    return ctx


def merge_parts(per_model: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    if len(per_model) == 1:
        return next(iter(per_model.values()))
    out: dict[str, dict[str, Any]] = {}
    names = sorted({n for parts in per_model.values() for n in parts})
    for name in names:
        entries = {m: parts.get(name, missing("not run")) for m, parts in per_model.items()}
        statuses = {e["status"] for e in entries.values()}
        status = statuses.pop() if len(statuses) == 1 else "partial"
        why = [f"{m}: {e['reason']}" for m, e in entries.items() if e.get("reason")]
        notes = [f"{m}: {e['note']}" for m, e in entries.items() if e.get("note")]
        out[name] = {"status": status}
        if why:
            out[name]["reason"] = "; ".join(why)
        if notes:
            out[name]["note"] = "; ".join(notes)
    return out


def run_analysis(
    inputs: Mapping[str, Sequence[str | os.PathLike]],
    params: Mapping[str, Any],
    out_dir: str | os.PathLike,
) -> dict[str, Any]:
    """Compute every statistic of the study from the artefacts; write them into `out_dir`.

    `inputs`: kind -> paths, kinds from `DATA_KINDS` (+ `model_summary`, `calibration` JSON for
    the report); any may be empty (that part is marked missing). Artefacts of several models
    (`results/{model}/...`) are analysed per model; every table gets a `model` column and every
    scalar result a `model` key. `params`: see `AnalysisParams.from_mapping` (`policies`,
    `expb` {primary, alpha, min_heavy_fraction, max_gap}, `n_boot`, `seed`, `ci_level`,
    `alpha`, `power`, `baseline`, `host_baseline`, `admission_bins`). Writes
    `<name>.parquet` for every name in `OUTPUT_FILES` and `analysis.json`; returns the content
    of `analysis.json`.
    """
    files = check_inputs(inputs)
    p = AnalysisParams.from_mapping(params)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} exists and is not a directory")
    groups = split_by_model(files)
    analyses = {}
    for model, group in tqdm(groups.items(), desc="analysis", unit="model", disable=None):
        analyses[model] = analyse_model(group, p)

    bench, bench_part, bench_prov = engine_bench(files["engine_bench"])
    tables: dict[str, pd.DataFrame] = {
        "engine_bench": bench,
        "models": pd.DataFrame([a.model_row(m) for m, a in analyses.items()]),
    }
    for name in OUTPUT_FILES:
        if name in tables:
            continue
        frames = [
            a.tables[name].assign(model=m)[["model", *a.tables[name].columns]]
            for m, a in analyses.items()
            if not a.tables.get(name, pd.DataFrame()).empty
        ]
        tables[name] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        write_table(tables[name], out / f"{name}.parquet")

    def tagged(key: str) -> list[dict[str, Any]]:
        res = []
        for m, a in analyses.items():
            value = a.results.get(key)
            if isinstance(value, list):
                res.extend({"model": m, **v} for v in value)
            elif value is not None:
                res.append({"model": m, **value})
        return res

    parts = merge_parts({m: a.parts for m, a in analyses.items()})
    parts["engine_bench"] = bench_part
    doc = none_if_nan(
        {
            "params": asdict(p),
            "ci_label": level_label(p.ci_level),
            "units": {"mass": "substituted gate mass per token-layer"},
            "models": list(analyses),
            "parts": parts,
            "dppl_base": {m: a.results.get("dppl_base", {}) for m, a in analyses.items()},
            "mass_hypothesis": tagged("mass_hypothesis"),
            "expb": tagged("expb"),
            "admission": tagged("admission"),
            "sim_vs_engine": tagged("sim_vs_engine"),
            "regime": tagged("regime"),
            "provenance": [{**r, "model": m} for m, a in analyses.items() for r in a.provenance()]
            + bench_prov,
            "files": {name: f"{name}.parquet" for name in OUTPUT_FILES},
        }
    )
    write_json(doc, out / "analysis.json")
    return json.loads(json.dumps(doc))
