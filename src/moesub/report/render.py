"""`render_report`: the analysis outputs -> one self-contained HTML file (figures embedded)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from moesub.hardware import CONTENDED_BELOW, PRICE_HELD_TO, SHARED_ABOVE, STUDY_PROFILE
from moesub.io import atomic_path
from moesub.report.claims import claim_lines, family_lines, kind_lines, tests_table
from moesub.report.degeneration import degeneration_lines, degeneration_table
from moesub.report.design import design_families_table, design_lines, design_space_table
from moesub.report.experiments import (
    admission_bins_table,
    admission_table,
    expb_designs,
    expb_rules,
)
from moesub.report.factorial import (
    factorial_cells_table,
    factorial_lines,
    factorial_tests_table,
)
from moesub.report.figures import draw_figures
from moesub.report.headline import headline
from moesub.report.load import (
    ci_label,
    disabled_parts,
    load_outputs,
    load_recommendations,
    summarize_reasons,
)
from moesub.report.plotting import FigureData
from moesub.report.pricing import (
    bench_lines,
    concurrency_table,
    sim_vs_engine_lines,
    sim_vs_engine_table,
)
from moesub.report.recommendation import (
    plans_table,
    recommendation_lines,
    recommendation_table,
    study_lines,
)
from moesub.report.regime import (
    allocation_table,
    designs_table,
    regime_design_lines,
    regime_table,
    regime_verdicts,
    skew_table,
)
from moesub.report.tables import (
    frame_table,
    generation_missing,
    generation_table,
    mass_table,
    models_table,
    per_input_table,
    policy_numbers,
    summary_table,
)

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
TEMPLATE = "report.html.j2"
# parts whose section shows notes
SECTION_NOTES = ("expb", "expb_factorial", "admission", "generation", "degeneration", "regime")


def machine_info() -> dict[str, Any]:
    """Where the report was rendered (the analysis machine); engine devices come from the data."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages * size / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    for pkg in ("moesub", "torch", "transformers", "duckdb", "scipy", "seaborn"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = "not installed"
    return info


def render_report(
    analysis_dir: str | os.PathLike,
    params: Mapping[str, Any],
    out_html: str | os.PathLike,
    fig_dir: str | os.PathLike | None = None,
    recommendations: Sequence[str | os.PathLike] = (),
    plans: Sequence[str | os.PathLike] = (),
) -> Path:
    """Render the report from the analysis outputs in `analysis_dir` and the recommend stage's
    `recommendations` (results/{model}/recommendation.json; the report opens with them) and
    `plans` (results/{model}/plan/{hardware}/{size}.json, listed beside them).

    `params`: the configuration shown in the report (`params["machine"]`, if given, describes the
    machine the measurements ran on). Figures also go to `fig_dir` (default `<out_html's
    folder>/figures`) for Snakemake's `report()` tags. Returns `out_html`.
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"params must be a mapping, got {type(params).__name__}")
    out = load_outputs(analysis_dir)
    out.disabled = disabled_parts(params)
    recommended = load_recommendations(recommendations)
    out_html = Path(out_html)
    fig_dir = Path(fig_dir) if fig_dir is not None else out_html.parent / "figures"
    numbers = policy_numbers(out)
    figures = draw_figures(FigureData(out, numbers), fig_dir)
    prov = out.doc.get("provenance") or []
    expb_side, expb_all = expb_designs(out)
    # a part's note shows once: in its section when it has one, else in the parts table
    notes = {
        name: summarize_reasons(str(p["note"]))
        for name, p in (out.doc.get("parts") or {}).items()
        if p.get("note")
    }
    parts = {
        name: {
            "status": "disabled" if name in out.disabled else p.get("status", "?"),
            "why": out.disabled.get(name)
            or summarize_reasons(str(p.get("reason") or ""))
            or ("" if name in SECTION_NOTES else notes.get(name, "")),
        }
        for name, p in (out.doc.get("parts") or {}).items()
    }
    ctx = {
        "title": str(params.get("title", "moesub report")),
        "ci": ci_label(out.ci_level),
        "baseline": out.baseline,
        "recommendation": recommendation_table(recommended, ci_label(out.ci_level), out.models),
        "plans": plans_table([str(p) for p in plans]),
        "recommendation_lines": recommendation_lines(
            recommended, ci_label(out.ci_level), out.models
        ),
        "study_lines": study_lines(recommended, out.models),
        "claims": claim_lines(out),
        "headline": headline(out),
        "families": family_lines(out),
        "tests": {f: tests_table(out, f) for f in ("pre-registered", "exploratory")},
        "summary": summary_table(out, numbers),
        "figures": {f.name: f for f in figures},
        "parts": parts,
        "notes": {name: notes[name] for name in SECTION_NOTES if name in notes},
        "why_missing": out.why_missing,
        "mass": mass_table(out),
        "rule_contrast": kind_lines(out, "dppl_contrast"),
        "mass_min_points": out.params.get("mass_min_points", "the configured number of"),
        "mass_cluster_gap": out.params.get("mass_cluster_gap", "the configured share"),
        "per_input": per_input_table(out),
        "expb_rules": expb_rules(out),
        "expb_alpha": (out.params.get("expb") or {}).get("alpha", out.params.get("alpha")),
        "expb_designs": expb_side,
        "expb_all": expb_all,
        "expb_factorial_lines": factorial_lines(out),
        "expb_factorial_tests": factorial_tests_table(out),
        "expb_factorial_cells": factorial_cells_table(out),
        "admission": admission_table(out),
        "admission_bins": admission_bins_table(out),
        "regime": regime_table(out),
        "design_space": design_space_table(out, numbers),
        "design_families": design_families_table(out),
        "design_lines": design_lines(out),
        "regime_verdicts": regime_verdicts(out),
        "skew": skew_table(out),
        "regime_designs": designs_table(out),
        "regime_design_lines": regime_design_lines(out),
        "allocation": allocation_table(out),
        "sim_vs_engine": sim_vs_engine_lines(out),
        "sim_vs_engine_rows": sim_vs_engine_table(out),
        "concurrency": concurrency_table(out),
        "study_profile": STUDY_PROFILE,
        "dppl_base": out.doc.get("dppl_base") or {},
        "generation": generation_table(out),
        "generation_missing": generation_missing(out),
        "degeneration": degeneration_table(out),
        "degeneration_lines": degeneration_lines(out),
        "engine_bench": frame_table("bench-table", out.table("engine_bench")),
        "bench_lines": bench_lines(out),
        "price_held_to": PRICE_HELD_TO,
        "contended_below": CONTENDED_BELOW,
        "shared_above": SHARED_ABOVE,
        "models": models_table(out),
        "absent": out.absent,
        "machine": machine_info(),
        "run_machine": params.get("machine"),
        "devices": sorted(
            {
                f"{p['metadata'].get('device')} ({p['metadata'].get('tier')})"
                for p in prov
                if p.get("kind") == "engine"
            }
        ),
        "build_ids": sorted(
            {
                str(p["metadata"]["core_build_id"])
                for p in prov
                if (p.get("metadata") or {}).get("core_build_id") is not None
            }
        ),
        "provenance": prov,
        "config": json.dumps(params, indent=2, sort_keys=True, default=str),
        "analysis_params": json.dumps(out.params, indent=2, sort_keys=True),
    }
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    html = env.get_template(TEMPLATE).render(**ctx)
    with atomic_path(out_html, suffix=".html") as tmp:
        tmp.write_text(html, encoding="utf-8")
    return out_html
