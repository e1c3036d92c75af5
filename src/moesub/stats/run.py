"""`run_analysis`: every part, per model, then the output files.

`analyse_model` is the data flow of one model written out: each part is a function of the
tables it needs (the loaded token tables, the files of one kind, or earlier parts' returned
tables) and the params, and returns its own typed result; nothing is shared between parts
but what one call hands the next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
from tqdm.auto import tqdm

from moesub.io import write_json
from moesub.stats.admission import admission
from moesub.stats.allocation import allocation
from moesub.stats.claims import claims
from moesub.stats.degeneration import degeneration
from moesub.stats.design import design_space
from moesub.stats.expb import expb
from moesub.stats.expb_factorial import expb_factorial
from moesub.stats.generation import generation
from moesub.stats.intervals import level_label
from moesub.stats.load import (
    check_inputs,
    missing,
    model_row,
    none_if_nan,
    provenance,
    read_infos,
    split_by_model,
    write_table,
)
from moesub.stats.mass import mass_hypothesis
from moesub.stats.multiplicity import families, family_table
from moesub.stats.params import AnalysisParams
from moesub.stats.per_input import per_input
from moesub.stats.pricing_error import engine_bench
from moesub.stats.quality import quality, rule_contrast
from moesub.stats.regime import regime
from moesub.stats.selection import selection
from moesub.stats.summary import summary
from moesub.stats.timing import (
    calibration_run_errors,
    engine,
    priced,
    sim_vs_engine,
    simulate,
    speed_quality,
)
from moesub.stats.tokens import load_tokens

OUTPUT_FILES = (
    "models",
    "summary",
    "mass_points",
    "per_input",
    "per_input_points",
    "expb",
    "expb_streams",
    "expb_factorial",
    "expb_factorial_cells",
    "expb_factorial_streams",
    "admission",
    "allocation",
    "speed_quality",
    "sim_vs_engine",
    "priced",
    "layer_hit_rates",
    "engine_bench",
    "generation",
    "degeneration",
    "regime",
    "regime_designs",
    "design_space",
    "design_families",
    "tests",
    "selection",
)
# the analysis.json keys of the per-model results (each entry tagged with its model)
RESULTS = (
    "claims",
    "families",
    "mass_hypothesis",
    "expb",
    "expb_factorial",
    "admission",
    "sim_vs_engine",
    "regime",
    "selection",
)


@dataclass(frozen=True)
class ModelAnalysis:
    """One model's outputs: `tables` (output file name -> table, without the model column; the
    engine benchmark and the models table are not per model), `results` (`RESULTS` key ->
    JSON-able dict, list of dicts or None), `parts` (part -> status), `dppl_base`, its row of
    `models.parquet` and its provenance."""

    tables: dict[str, pd.DataFrame]
    results: dict[str, Any]
    parts: dict[str, dict[str, Any]]
    dppl_base: dict[str, str]
    model_row: dict[str, Any]
    provenance: list[dict[str, Any]]


def analyse_model(model: str, paths: dict[str, list[str]], p: AnalysisParams) -> ModelAnalysis:
    """Every part on one model's artefacts (`paths`: kind -> paths), in data-flow order."""
    infos = read_infos(paths)
    with duckdb.connect() as db:  # the parts that read tokens or files query it while open
        db.execute("SET threads TO 2").fetchall()
        tokens = load_tokens(db, paths["capture_tokens"], infos["emulate"], p.baseline)
        qual = quality(tokens, p)
        mass = mass_hypothesis(qual.streams, infos["emulate"], p)
        units = per_input(qual.streams, tokens, p)
        split = selection(qual.streams, p)
        exp = expb(tokens, infos["expb"], paths["expb_feasibility"], p)
        fac = expb_factorial(
            tokens, infos["expb_factorial"], paths["expb_factorial_feasibility"], p
        )
        adm = admission(tokens, infos["emulate"], p)
        sim = simulate(db, infos["simulate"])
        eng = engine(db, infos["engine"], p)
        gen = generation(db, infos["generate"], p)
        degen = degeneration(db, infos["generate"], qual.table, p)
    prices, sim_total = priced(paths["priced"], sim.total)
    sim = sim._replace(total=sim_total)
    space = design_space(sim.total, sim.layers, qual.table, p)
    speed = speed_quality(qual.table, eng.table, sim.total, p)
    sve = sim_vs_engine(eng.table, sim.total, prices, p, calibration_run_errors(paths["priced"]))
    alloc = allocation(qual.streams, qual.table, prices, infos["emulate"], p)
    reg = regime(paths["regime"], paths["regime_designs"])
    summ = summary(qual.table, sim.total, eng.table, gen.table, p)
    tests = family_table(
        [
            *rule_contrast(qual.streams, p),
            *mass.tests,
            *exp.tests,
            *fac.tests,
            *adm.tests,
            *alloc.tests,
            *units.tests,
            *gen.tests,
            *degen.tests,
        ],
        p.alpha,
    )
    verdicts = claims(tests, qual.table, eng.table, sim.total, p)
    return ModelAnalysis(
        tables={
            "summary": summ.table,
            "mass_points": mass.points,
            "per_input": units.table,
            "per_input_points": units.points,
            "expb": exp.table,
            "expb_streams": exp.streams,
            "expb_factorial": fac.table,
            "expb_factorial_cells": fac.cells,
            "expb_factorial_streams": fac.streams,
            "admission": adm.table,
            "allocation": alloc.table,
            "speed_quality": speed.table,
            "sim_vs_engine": sve.table,
            "priced": prices,
            "layer_hit_rates": sim.layers,
            "generation": gen.table,
            "degeneration": degen.table,
            "regime": reg.table,
            "regime_designs": reg.designs,
            "design_space": space.table,
            "design_families": space.families,
            "tests": tests,
            "selection": split.table,
        },
        results={
            "claims": verdicts.results,
            "families": families(tests, p.alpha),
            "mass_hypothesis": mass.results,
            "expb": exp.results,
            "expb_factorial": fac.results,
            "admission": adm.totals,
            "sim_vs_engine": sve.result,
            "regime": reg.result,
            "selection": split.result,
        },
        parts={
            "quality": qual.status,
            "mass_hypothesis": mass.status,
            "per_input": units.status,
            "expb": exp.status,
            "expb_factorial": fac.status,
            "admission": adm.status,
            "allocation": alloc.status,
            "simulate": sim.status,
            "design_space": space.status,
            "engine": eng.status,
            "speed_quality": speed.status,
            "sim_vs_engine": sve.status,
            "generation": gen.status,
            "degeneration": degen.status,
            "regime": reg.status,
            "summary": summ.status,
            "claims": verdicts.status,
            "selection": split.status,
        },
        dppl_base=tokens.dppl_base,
        model_row=model_row(model, paths["model_summary"], infos),
        provenance=provenance(paths, infos),
    )


def each(model: str, text: str) -> str:
    """`text`'s '; '-separated items, each prefixed with `model: `."""
    return "; ".join(f"{model}: {item}" for item in text.split("; "))


def merge_parts(per_model: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    if len(per_model) == 1:
        return next(iter(per_model.values()))
    out: dict[str, dict[str, Any]] = {}
    names = sorted({n for parts in per_model.values() for n in parts})
    for name in names:
        entries = {m: parts.get(name, missing("not run")) for m, parts in per_model.items()}
        statuses = {e["status"] for e in entries.values()}
        status = statuses.pop() if len(statuses) == 1 else "partial"
        # every item of a '; '-joined list named with its model, so that the report can
        # say a reason once for all the models it holds for
        why = [each(m, e["reason"]) for m, e in entries.items() if e.get("reason")]
        notes = [each(m, e["note"]) for m, e in entries.items() if e.get("note")]
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
        analyses[model] = analyse_model(model, group, p)

    bench = engine_bench(files["engine_bench"], p)
    tables: dict[str, pd.DataFrame] = {
        "engine_bench": bench.table,
        "models": pd.DataFrame([a.model_row for a in analyses.values()]),
    }
    for name in OUTPUT_FILES:
        if name in tables:
            continue
        frames = [
            a.tables[name].assign(model=m)[["model", *a.tables[name].columns]]
            for m, a in analyses.items()
            if not a.tables[name].empty
        ]
        tables[name] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        write_table(tables[name], out / f"{name}.parquet")

    def tagged(key: str) -> list[dict[str, Any]]:
        res = []
        for m, a in analyses.items():
            value = a.results[key]
            if isinstance(value, list):
                res.extend({"model": m, **v} for v in value)
            elif value is not None:
                res.append({"model": m, **value})
        return res

    parts = merge_parts({m: a.parts for m, a in analyses.items()})
    parts["engine_bench"] = bench.status
    doc = none_if_nan(
        {
            "params": asdict(p),
            "ci_label": level_label(p.ci_level),
            "units": {"mass": "substituted gate mass per token-layer"},
            "models": list(analyses),
            "parts": parts,
            "dppl_base": {m: a.dppl_base for m, a in analyses.items()},
            **{key: tagged(key) for key in RESULTS},
            "provenance": [{**r, "model": m} for m, a in analyses.items() for r in a.provenance]
            + bench.provenance,
            "files": {name: f"{name}.parquet" for name in OUTPUT_FILES},
        }
    )
    write_json(doc, out / "analysis.json")
    return json.loads(json.dumps(doc))
