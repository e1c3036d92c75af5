"""What the report reads: the analysis outputs (`analysis.json` and its named Parquet files) and
the recommend stage's JSON documents.

The analysis writes one file per table (`analysis.json["files"]` names them); the report never
opens a stage artefact. A table that is absent, unreadable or has no columns loads as an empty
frame, and its reason is recorded once, so a section shows one clear message instead of an error.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd
import pyarrow.parquet as pq


def read_table(path: Path) -> pd.DataFrame:
    """One Parquet file through DuckDB; an empty frame if it has no columns."""
    if len(pq.read_schema(path)) == 0:
        return pd.DataFrame()
    con = duckdb.connect()
    try:
        return con.execute("SELECT * FROM read_parquet(?)", [str(path)]).df()
    finally:
        con.close()


@dataclass
class AnalysisOutputs:
    """`analysis.json` (`doc`) and its tables; `absent`: table -> why it is not there;
    `disabled`: part -> the config key that turned its stage off (`disabled_parts`)."""

    directory: Path
    doc: dict[str, Any]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    disabled: dict[str, str] = field(default_factory=dict)

    @property
    def params(self) -> dict[str, Any]:
        return self.doc.get("params") or {}

    @property
    def ci_level(self) -> float:
        return float(self.params.get("ci_level", 0.95))

    @property
    def baseline(self) -> str:
        return str(self.params.get("baseline", "fetch_every_miss"))

    @property
    def models(self) -> list[str]:
        """The models in the analysis' order: every table, figure and line follows it."""
        return [str(m) for m in self.doc.get("models") or []]

    def by_model(self, df: pd.DataFrame, *then: str) -> pd.DataFrame:
        """`df` ordered by model (the analysis' order), then by the columns `then` it has."""
        if df.empty or "model" not in df.columns:
            keys = [c for c in then if c in df.columns]
            return df.sort_values(keys, kind="stable") if keys else df
        rank = {m: i for i, m in enumerate(self.models)}
        order = df.assign(_model=df["model"].astype(str).map(rank).fillna(len(rank)))
        keys = ["_model", *[c for c in then if c in df.columns]]
        return order.sort_values(keys, kind="stable").drop(columns="_model")

    def configured(self, policy: str) -> bool:
        """A policy of the config's `policies:` (or the engine's reserved all_resident); every
        policy when the analysis recorded no config policies."""
        names = self.params.get("policies") or {}
        return not names or policy in names or policy == "all_resident"

    def table(self, name: str) -> pd.DataFrame:
        return self.tables.get(name, pd.DataFrame())

    def part(self, name: str) -> dict[str, Any]:
        return (self.doc.get("parts") or {}).get(name) or {}

    def why_missing(self, part: str, table: str | None = None) -> str:
        """One message for a part without data: the stage disabled in the config, else the
        analysis's reason, else the file's."""
        if part in self.disabled:
            return self.disabled[part]
        reason = self.part(part).get("reason")
        if reason:
            return summarize_reasons(str(reason))
        if table is not None and table in self.absent:
            return self.absent[table]
        return f"the analysis wrote no {part} results"


def load_outputs(analysis_dir: str | os.PathLike) -> AnalysisOutputs:
    """`analysis.json` and every table it names (else every `*.parquet` beside it)."""
    adir = Path(analysis_dir)
    doc_path = adir / "analysis.json"
    if not doc_path.is_file():
        raise FileNotFoundError(f"analysis_dir={str(adir)!r} has no analysis.json (run_analysis)")
    doc = json.loads(doc_path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{doc_path}: expected a JSON object, got {type(doc).__name__}")
    files = doc.get("files") or {p.stem: p.name for p in sorted(adir.glob("*.parquet"))}
    out = AnalysisOutputs(directory=adir, doc=doc)
    for name, rel in files.items():
        path = adir / str(rel)
        if not path.is_file():
            out.absent[name] = f"{path.name} is missing from the analysis outputs"
            continue
        try:
            out.tables[name] = read_table(path)
        except Exception as exc:  # noqa: BLE001 - shown in the report instead of failing it
            out.absent[name] = f"{path.name} is unreadable: {exc}"
    return out


def disabled_parts(config: Mapping[str, Any]) -> dict[str, str]:
    """part -> "disabled in the config (key: value)" for each part whose stage the config
    turns off: a disabled stage is said as disabled, not as missing data."""

    def get(*keys: str) -> Any:
        node: Any = config
        for key in keys:
            node = node.get(key) if isinstance(node, Mapping) else None
        return node

    off = {  # config keys and the value that turns the stage off -> the parts it feeds
        ("engine", "bench", "enabled"): (False, ("engine_bench",)),
        ("engine", "policies"): ([], ("engine", "sim_vs_engine")),
        ("emulate", "policies"): ([], ("quality", "mass_hypothesis", "per_input", "admission")),
        ("simulate", "policies"): ([], ("simulate", "design_space")),
        ("generate", "tasks"): ({}, ("generation", "degeneration")),
        ("expb", "designs"): ({}, ("expb",)),
    }
    out = {}
    for keys, (value, parts) in off.items():
        if get(*keys) == value:
            shown = json.dumps(value).lower()
            out |= {part: f"disabled in the config ({'.'.join(keys)}: {shown})" for part in parts}
    return out


def load_documents(
    paths: Iterable[str | os.PathLike], what: str, rule: str, keys: tuple[str, ...]
) -> list[dict[str, Any]]:
    """Another stage's JSON documents in the given order; a missing file, or one without
    `keys`, is an error naming it, `what` it should be and the `rule` that writes it."""
    docs = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{what} {str(path)!r} is missing (rule {rule})")
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not set(keys) <= set(doc):
            raise ValueError(f"{path}: not a {what} (needs keys {', '.join(keys)})")
        docs.append(doc)
    return docs


def load_recommendations(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """The recommend stage's documents (results/{model}/recommendation.json)."""
    return load_documents(paths, "recommendation", "recommend", ("model", "rankings"))


def load_plans(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """The plan stage's documents (results/{model}/plan/{hardware}/{size}.json, docs/plan.md)."""
    keys = ("model", "hardware", "size", "choice", "policy_name", "layers", "pins_file")
    return load_documents(paths, "plan", "plan", keys)


# columns a figure cannot do without; an analysis that lacks one gets a message, not a crash
NEEDS: dict[str, tuple[str, ...]] = {
    "mass_vs_dppl": ("group", "policy", "dppl_pct"),
    "speed_quality": ("source", "policy", "time_per_token_s", "dppl_pct", "frontier"),
    "admission": ("policy", "twin", "fraction", "bin", "bin_label", "dnll_mean"),
    "expb": ("design", "target_mass", "realized_heavy", "realized_light", "effect", "valid"),
    "regime": ("layer", "metric", "value"),
    "layer_hit_rates": ("policy", "fraction", "layer", "hit_rate", "tokens"),
    "sim_vs_engine": ("policy", "time_mean_s", "est_time_per_token_s", "rel_error"),
    "generation": ("task", "policy", "n", "accuracy"),
    "degeneration": (
        "task",
        "policy",
        "fraction",
        "measure",
        "mean",
        "ci_lo",
        "ci_hi",
        "dppl_pct",
        "dppl_ci_lo",
        "dppl_ci_hi",
    ),  # fmt: skip
    "per_input": ("level", "policy", "unit", "dnll_mean"),
    "design_space": (
        "policy",
        "family",
        "bound",
        "est_time_per_token_s",
        "dppl_pct",
        "dppl_ci_lo",
        "dppl_ci_hi",
        "moved_mass_per_token_layer",
        "frontier",
        "frontier_mass",
        "fraction",
    ),
}


def lacking(df: pd.DataFrame, name: str) -> list[str]:
    return [c for c in NEEDS.get(name, ()) if c not in df.columns]


def regime_wide(out: AnalysisOutputs) -> pd.DataFrame:
    """regime.parquet's (model, layer, metric, value, reference, ...) rows as one row per (model,
    layer) and one column per metric, plus `capacity` from analysis.json's regime entry and
    `ref_<metric>` / `trace_ref_<metric>` for the reference figures (all layers' row only)."""
    long = out.table("regime")
    if long.empty or lacking(long, "regime"):
        return pd.DataFrame()
    if "model" not in long.columns:
        long = long.assign(model="")
    metrics = unique(long["metric"].astype(str))  # the analysis's order (reuse bins ascending)
    wide = long.pivot_table(
        index=["model", "layer"], columns="metric", values="value", dropna=False
    )[metrics]
    for src, prefix in (("reference", "ref_"), ("trace_study_reference", "trace_ref_")):
        if src in long.columns and long[src].notna().any():
            refs = long.pivot_table(index=["model", "layer"], columns="metric", values=src)
            wide = wide.join(refs.add_prefix(prefix))
    wide = wide.reset_index()
    wide.columns.name = None
    capacity = {str(r.get("model", "")): r.get("capacity") for r in out.doc.get("regime") or []}
    return wide.assign(capacity=wide["model"].astype(str).map(capacity))


def column(df: pd.DataFrame, *names: str) -> str | None:
    """The first of `names` that `df` has (analysis versions name some columns differently)."""
    return next((n for n in names if n in df.columns), None)


def finite(v: Any) -> bool:
    """A real number that can be shown (not None, NaN, inf or a non-number)."""
    if v is None or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def ci_label(level: float) -> str:
    """'90% CI' for ci_level 0.9: every interval in the report is labelled from the config."""
    return f"{100 * level:g}% CI"


_JOB_PREFIX = re.compile(r"^(?:[\w.+-]+/)*[\w.+-]+: ")


def summarize_reasons(text: str) -> str:
    """Collapse a '; '-joined list of per-job reasons into one line per distinct reason.

    "a: gsm8k/p1: no data; a: gsm8k/p2: no data" -> "no data (a: gsm8k/p1, a: gsm8k/p2)";
    a job prefix is one word or path (model, task/policy) followed by ": ".
    """
    items = [t.strip() for t in text.split("; ") if t.strip()]
    by_reason: dict[str, list[str]] = {}
    for item in items:
        rest, jobs = item, []
        while m := _JOB_PREFIX.match(rest):
            jobs.append(m.group(0)[:-2])
            rest = rest[m.end() :]
        by_reason.setdefault(rest, []).append(": ".join(jobs))
    parts = []
    for reason, jobs in by_reason.items():
        named = [j for j in jobs if j]
        if len(jobs) > 1 and named:
            shown = ", ".join(named[:3]) + (f", … ({len(named)} in all)" if len(named) > 3 else "")
            parts.append(f"{reason} ({shown})")
        else:
            parts.append(f"{named[0]}: {reason}" if named else reason)
    return "; ".join(parts)


def unique(values: Iterable[Any]) -> list[Any]:
    """Values in first-seen order without repeats."""
    seen: list[Any] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen
