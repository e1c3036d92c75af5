"""Loading: input checking, per-file metadata, the split by model.

`read_infos` gives each input file's `FileInfo` (its metadata and the keys its path gives
it); `model_row` and `provenance` give a model's row of `models.parquet` and its
`analysis.json` provenance; the small helpers every part uses (`missing`, `sql_list`, ...)
are here too. The per-token tables in DuckDB are `moesub.stats.tokens`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from moesub.config import FACTORIAL_CELLS
from moesub.io import read_metadata, write_parquet
from moesub.policy import capacity_for

DATA_KINDS = (
    "capture_tokens",
    "simulate",
    "emulate",
    "expb",
    "expb_feasibility",
    "expb_factorial",
    "expb_factorial_feasibility",
    "engine",
    "engine_bench",
    "generate",
)
# Non-Parquet inputs the report shows (model summary JSON, engine calibration JSON), and the
# per-model tables the parts read themselves: the regime (results/{model}/regime.parquet,
# regime_designs.parquet) and the priced runs (results/{model}/priced/{hardware}.parquet).
EXTRA_KINDS = ("model_summary", "calibration", "regime", "regime_designs", "priced")
PROVENANCE_KEYS = (
    "name",
    "policy",
    "fraction",
    "capacity",
    "core_build_id",
    "device",
    "tier",
    "condition",
    "target_mass",
    "model",
    "num_experts",
    "top_k",
    "num_layers",
    "layout",  # per-layer capacities and pins: the recommendation's slots and the plan's layout
)


STAGE_DIRS = {
    "capture_tokens": "capture",
    "simulate": "simulate",
    "emulate": "emulate",
    "expb": "expb",
    "expb_feasibility": "expb",
    "expb_factorial": "expb",
    "expb_factorial_feasibility": "expb",
    "engine": "engine",
    "generate": "generate",
    "calibration": "engine",
    "priced": "priced",
}


def model_of(path: str, kind: str) -> str:
    """The `{model}` of an artefact path `.../{model}/{stage}/...` ("" when the path has none)."""
    parts = Path(path).parts
    if (
        kind == "model_summary"
    ):  # results/{model}/model/train_summary.json or {model}/checkpoint.json
        return (
            parts[-3]
            if len(parts) >= 3 and parts[-2] == "model"
            else (parts[-2] if len(parts) >= 2 else "")
        )
    if kind in ("regime", "regime_designs"):  # results/{model}/regime*.parquet
        return parts[-2] if len(parts) >= 2 else ""
    stage = STAGE_DIRS.get(kind)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == stage:
            return parts[i - 1]
    return ""


def split_by_model(files: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
    """model -> inputs of that model (engine_bench is shared and left out); at least one group."""
    groups: dict[str, dict[str, list[str]]] = {}
    for kind, paths in files.items():
        if kind == "engine_bench":
            continue
        for path in paths:
            model = model_of(path, kind)
            group = groups.setdefault(model, {k: [] for k in DATA_KINDS + EXTRA_KINDS})
            group[kind].append(path)
    return dict(sorted(groups.items())) or {"": {k: [] for k in DATA_KINDS + EXTRA_KINDS}}


def check_inputs(inputs: Mapping[str, Any]) -> dict[str, list[str]]:
    """kind -> sorted list of existing paths; every data kind present (maybe empty)."""
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must map artefact kinds to lists of paths, got {type(inputs)}")
    out: dict[str, list[str]] = {}
    for kind, paths in inputs.items():
        if kind not in DATA_KINDS + EXTRA_KINDS:
            raise ValueError(
                f"inputs: unknown kind {kind!r}; expected some of {list(DATA_KINDS + EXTRA_KINDS)}"
            )
        if paths is None:
            paths = []
        elif isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        listed = sorted({str(p) for p in paths})
        for p in listed:
            if not Path(p).is_file():
                raise FileNotFoundError(f"inputs[{kind!r}]: {p!r} does not exist")
        out[kind] = listed
    for kind in DATA_KINDS + EXTRA_KINDS:
        out.setdefault(kind, [])
    return out


@dataclass
class FileInfo:
    """One input Parquet file: its metadata and the keys its path/metadata give it."""

    path: str
    kind: str
    rows: int
    meta: dict[str, Any]
    name: str | None = None
    fraction: float | None = None
    device: str | None = None
    condition: str | None = None
    target_mass: float | None = None
    num_layers: int | None = None  # L (metadata), to put emulate's mass per token-layer


def _prefixed_number(stem: str, prefix: str) -> float | None:
    if stem.startswith(prefix):
        try:
            return float(stem[len(prefix) :])
        except ValueError:
            return None
    return None


def file_info(path: str, kind: str) -> FileInfo:
    """Metadata first, then the architecture's path layout (`.../{policy}/f{fraction}.parquet`)."""
    try:
        meta = read_metadata(path)
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument named
        raise ValueError(
            f"inputs[{kind!r}]: {path!r} is not a readable Parquet file: {exc}"
        ) from exc
    p = Path(path)
    info = FileInfo(path=path, kind=kind, rows=rows, meta=meta)
    if kind in ("simulate", "emulate", "engine"):
        name = meta.get("name")
        if not isinstance(name, str):
            name = meta.get("policy") if isinstance(meta.get("policy"), str) else p.parent.name
        info.name = name
        frac = meta.get("fraction")
        info.fraction = float(frac) if frac is not None else _prefixed_number(p.stem, "f")
        if info.fraction is None:
            raise ValueError(f"inputs[{kind!r}]: {path!r} has no fraction (metadata or f<x> name)")
        if kind == "emulate":
            layers = meta.get("num_layers")
            info.num_layers = int(layers) if layers is not None else None
            if layers is None and "layer_mass" not in pq.read_schema(path).names:
                raise ValueError(
                    f"inputs['emulate']: {path!r} has neither num_layers metadata nor a "
                    "layer_mass column: its mass (summed over layers) cannot be put per "
                    "token-layer"
                )
        if kind == "engine":
            info.device = str(meta.get("device") or p.parent.parent.name)
    elif kind == "expb":
        # name = the Experiment B design (.../expb/{design}/{condition}/m<mass>.parquet)
        info.name = str(meta.get("design") or p.parent.parent.name)
        info.condition = str(meta.get("condition") or p.parent.name)
        target = meta.get("target_mass")
        info.target_mass = float(target) if target is not None else _prefixed_number(p.stem, "m")
        if info.condition not in ("heavy", "light") or info.target_mass is None:
            raise ValueError(
                f"inputs['expb']: {path!r} needs condition heavy|light and a target_mass "
                f"(metadata or .../{{condition}}/m<mass>.parquet), got "
                f"{info.condition!r}, {info.target_mass!r}"
            )
    elif kind == "expb_factorial":
        # the cell (.../expb/factorial/{cell}.parquet)
        info.name = "factorial"
        info.condition = str(meta.get("condition") or p.stem)
        if info.condition not in FACTORIAL_CELLS:
            raise ValueError(
                f"inputs['expb_factorial']: {path!r} is not a factorial cell's run (condition "
                f"{info.condition!r}; cells {list(FACTORIAL_CELLS)})"
            )
    return info


def sql_list(paths: Sequence[str]) -> str:
    """A DuckDB list literal of file paths."""
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def none_if_nan(v: Any) -> Any:
    """JSON-able copy: NaN/inf -> None, numpy scalars -> Python scalars."""
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, dict):
        return {k: none_if_nan(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [none_if_nan(x) for x in v]
    return v


def missing(reason: str) -> dict[str, Any]:
    """The `parts` entry of a part that could not run."""
    return {"status": "missing", "reason": reason}


def write_table(df: pd.DataFrame, path: Path) -> None:
    """One output table, atomically (an empty frame still gives a readable file)."""
    write_parquet(df.reset_index(drop=True) if not df.empty else pd.DataFrame(df), path)


def read_infos(paths: Mapping[str, list[str]]) -> dict[str, list[FileInfo]]:
    """kind -> the `FileInfo` of each data file of one model; two files of the same run (same
    policy, fraction and device; for Experiment B same design, condition and target) refused."""
    infos = {k: [file_info(f, k) for f in paths[k]] for k in DATA_KINDS}
    for kind in ("simulate", "emulate", "engine"):
        seen: dict[tuple, str] = {}
        for info in infos[kind]:
            key = (info.name, info.fraction, info.device)
            if key in seen:
                raise ValueError(
                    f"inputs[{kind!r}]: {seen[key]!r} and {info.path!r} are the same run "
                    f"(policy {info.name!r}, fraction {info.fraction}): one model per analysis"
                )
            seen[key] = info.path
    seen = {}
    for info in infos["expb"] + infos["expb_factorial"]:
        key = (info.name, info.condition, info.target_mass)
        if key in seen:
            raise ValueError(f"inputs['expb']: {seen[key]!r} and {info.path!r} are the same run")
        seen[key] = info.path
    return infos


def not_run(summary: Mapping[str, Any]) -> str | None:
    """What the pipeline skipped for a trace model and why (its trace.json: stages, policies,
    hardware profiles), as one line."""
    why = [summary["skipped_stages"]] if summary.get("skipped_stages") else []
    why += [f"policy {p}: {r}" for p, r in (summary.get("skipped_policies") or {}).items()]
    why += [f"{h} not priced: {r}" for h, r in (summary.get("skipped_hardware") or {}).items()]
    return "; ".join(why) or None


def model_row(
    model: str, summaries: list[str], infos: Mapping[str, list[FileInfo]]
) -> dict[str, Any]:
    """One row of `models.parquet`: the model's summary JSON (the embedded model's
    train_summary.json or a checkpoint's checkpoint.json), its geometry E / k / L (capture
    metadata first, then the summary) and the cache capacity C at every fraction run."""
    summary: dict[str, Any] = {}
    source = None
    for path in summaries:  # one per model (split_by_model)
        summary = json.loads(Path(path).read_text())
        # results/{model}/model/train_summary.json, results/{model}/checkpoint.json or a
        # trace model's results/{model}/trace.json
        name = Path(path).name
        source = {"checkpoint.json": "checkpoint", "trace.json": "trace"}.get(name, "embedded")
    config = summary.get("config") or {}
    meta = infos["capture_tokens"][0].meta if infos["capture_tokens"] else {}

    def first(*values: Any) -> Any:
        return next((v for v in values if v is not None), None)

    num_experts = first(meta.get("num_experts"), summary.get("num_experts"),
                        config.get("num_experts"))  # fmt: skip
    row = {
        "model": model,
        "source": source,
        "family": first(meta.get("family"), summary.get("family")),
        "path": summary.get("path"),
        "num_experts": num_experts,
        "top_k": first(meta.get("top_k"), summary.get("top_k"), config.get("num_experts_per_tok")),
        "num_layers": first(meta.get("num_layers"), summary.get("num_layers")),
        "num_parameters": summary.get("num_parameters"),
        "heldout_perplexity": summary.get("heldout_perplexity"),
        "final_train_loss": summary.get("final_train_loss"),
        "train_tokens": summary.get("tokens_seen"),
        "train_time_s": summary.get("train_time_s"),
        "not_run": not_run(summary),
    }
    caps: dict[float, int | None] = {}
    labels: dict[float, str] = {}
    pricing: set[str] = set()
    for kind in ("simulate", "emulate", "engine"):
        for info in infos[kind]:
            cap = info.meta.get("capacity")
            if cap is None and num_experts is not None:
                cap = capacity_for(info.fraction, int(num_experts))
            caps.setdefault(float(info.fraction), None if cap is None else int(cap))
            size = info.meta.get("size") or {}
            labels.setdefault(float(info.fraction), size.get("label") or f"f{info.fraction:g}")
            if size.get("budget"):
                pricing.add(budget_pricing(size))
    row["fractions"] = sorted(caps)
    row["capacities"] = [caps[f] for f in sorted(caps)]
    row["sizes"] = [labels[f] for f in sorted(caps)]  # f<fraction> | b<budget> (path labels)
    row["pricing"] = "; ".join(sorted(pricing)) or None  # how each budget became C
    return row


def budget_pricing(size: Mapping[str, Any]) -> str:
    """How a budget size became slots per layer (its artefact metadata), in one line."""
    b = size["budget"]
    return (
        f"{size['label']}: {b['budget']} at {b['expert_bits']:g} bits per weight = "
        f"{b['expert_bytes']:.0f} B per expert -> C = {size['capacity']} per layer, priced at "
        f"the {b['pricing']['source']}"
    )


def provenance(
    paths: Mapping[str, list[str]], infos: Mapping[str, list[FileInfo]]
) -> list[dict[str, Any]]:
    """Every input file of one model: kind, path, rows and its metadata's `PROVENANCE_KEYS`."""
    out = [provenance_entry(info) for kind in DATA_KINDS for info in infos[kind]]
    for kind in EXTRA_KINDS:
        for path in paths[kind]:
            out.append({"kind": kind, "path": path, "rows": None, "metadata": {}})
    return out


def provenance_entry(info: FileInfo) -> dict[str, Any]:
    """One input file in `analysis.json["provenance"]`."""
    meta = {k: info.meta[k] for k in PROVENANCE_KEYS if k in info.meta}
    return {"kind": info.kind, "path": info.path, "rows": info.rows, "metadata": meta}
