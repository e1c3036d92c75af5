"""Loading: input checking, per-file metadata, the split by model, and the DuckDB tables.

`Context` is what every part function reads and fills: the DuckDB connection (with the
temporary tables `cap` = captured tokens and `emu` / `emu_base` = emulated tokens and the
baseline NLL at each fraction), the file infos, the params, and the three outputs
`tables` (name -> DataFrame), `results` (name -> JSON-able scalars) and `parts`
(name -> {status, reason?, note?}).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from moesub.config import normalize_policy
from moesub.io import read_metadata, write_parquet
from moesub.policy import capacity_for

if TYPE_CHECKING:
    from moesub.stats.params import AnalysisParams

DATA_KINDS = (
    "capture_tokens",
    "simulate",
    "emulate",
    "expb",
    "expb_feasibility",
    "engine",
    "engine_bench",
    "generate",
)
# Non-Parquet inputs the report shows (model summary JSON, engine calibration JSON), and the
# per-model regime table (results/{model}/regime.parquet), which the regime part reads itself.
EXTRA_KINDS = ("model_summary", "calibration", "regime")
FETCH_FIRST_RULES = ("threshold", "first_choice")
SUBSTITUTE_FIRST_RULES = ("substitute_all",)
NEVER_SUBSTITUTE_RULES = ("fetch_all", "host_compute")
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
)


STAGE_DIRS = {
    "capture_tokens": "capture",
    "simulate": "simulate",
    "emulate": "emulate",
    "expb": "expb",
    "expb_feasibility": "expb",
    "engine": "engine",
    "generate": "generate",
    "calibration": "engine",
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
    if kind == "regime":  # results/{model}/regime.parquet
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
    return info


def number(value: Any, where: str) -> float:
    """A config number (bools refused), or a ValueError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}={value!r} must be a number")
    return float(value)


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


class Context:
    """State shared by the parts of one model's analysis: DuckDB, file infos, params, outputs."""

    def __init__(self, inputs: dict[str, list[str]], params: AnalysisParams):
        self.inputs = inputs
        self.p = params
        self.con = duckdb.connect()
        self.con.execute("SET threads TO 2").fetchall()
        self.infos = {k: [file_info(f, k) for f in inputs[k]] for k in DATA_KINDS}
        self.parts: dict[str, dict[str, Any]] = {}
        self.tables: dict[str, pd.DataFrame] = {}
        self.results: dict[str, Any] = {}
        self._check_duplicates()

    def _check_duplicates(self) -> None:
        for kind in ("simulate", "emulate", "engine"):
            seen: dict[tuple, str] = {}
            for info in self.infos[kind]:
                key = (info.name, info.fraction, info.device)
                if key in seen:
                    raise ValueError(
                        f"inputs[{kind!r}]: {seen[key]!r} and {info.path!r} are the same run "
                        f"(policy {info.name!r}, fraction {info.fraction}): one model per analysis"
                    )
                seen[key] = info.path
        seen = {}
        for info in self.infos["expb"]:
            key = (info.name, info.condition, info.target_mass)
            if key in seen:
                raise ValueError(
                    f"inputs['expb']: {seen[key]!r} and {info.path!r} are the same run"
                )
            seen[key] = info.path

    def policy(self, name: str, info: FileInfo | None = None) -> dict[str, Any] | None:
        if name in self.p.policies:
            return self.p.policies[name]
        meta_p = info.meta.get("policy") if info is not None else None
        if isinstance(meta_p, Mapping):
            return normalize_policy(name, dict(meta_p))
        return None

    def register_files(self, kind: str) -> str:
        rows = [
            {
                "filename": i.path,
                "name": i.name,
                "fraction": i.fraction,
                "device": i.device,
                "condition": i.condition,
                "target_mass": i.target_mass,
                "num_layers": i.num_layers,
            }
            for i in self.infos[kind]
        ]
        table = f"files_{kind}"
        self.con.register(table, pd.DataFrame(rows))
        return table

    def load_tables(self) -> None:
        con = self.con
        if self.inputs["capture_tokens"]:
            con.execute(
                "CREATE TEMP TABLE cap AS SELECT stream, pos, doc_id, doc_start, nll "
                f"FROM read_parquet({sql_list(self.inputs['capture_tokens'])})"
            ).fetchall()
            dup = con.execute(
                "SELECT count(*) - count(DISTINCT (stream, pos)) FROM cap"
            ).fetchall()[0][0]
            if dup:
                raise ValueError(
                    f"inputs['capture_tokens']: {dup} duplicate (stream, pos) rows across "
                    f"{self.inputs['capture_tokens']}: pass one split of one model"
                )
        if self.inputs["emulate"]:
            files = self.register_files("emulate")
            # one mass unit: emulate's `mass` is the sum over the L layers; per token-layer here
            # (L from the metadata, else the length of layer_mass; file_info checked one exists)
            layers = "CAST(f.num_layers AS DOUBLE)"
            if any(i.num_layers is None for i in self.infos["emulate"]):
                layers = f"coalesce({layers}, len(t.layer_mass))"
            con.execute(
                "CREATE TEMP TABLE emu AS SELECT f.name, f.fraction, t.stream, t.pos, t.doc_id, "
                f"t.doc_start, t.nll, t.mass / {layers} AS mass, "
                't.hit, t."fetch", t.sub, t.host, t.forced '
                f"FROM read_parquet({sql_list(self.inputs['emulate'])}, filename=true, "
                f"union_by_name=true) t JOIN {files} f USING (filename)"
            ).fetchall()
            self._emulate_baseline()

    def _emulate_baseline(self) -> None:
        """emu_base(fraction, stream, pos, nll_b): the baseline's NLL at every fraction."""
        con, base = self.con, self.p.baseline
        con.execute(
            "CREATE TEMP TABLE emu_base AS SELECT fraction, stream, pos, nll AS nll_b "
            "FROM emu WHERE name = ?",
            [base],
        ).fetchall()
        fractions = [r[0] for r in con.execute("SELECT DISTINCT fraction FROM emu").fetchall()]
        have = {r[0] for r in con.execute("SELECT DISTINCT fraction FROM emu_base").fetchall()}
        self.results["dppl_base"] = {}
        for frac in sorted(fractions):
            if frac in have:
                self.results["dppl_base"][str(frac)] = f"{base} (emulated)"
            elif self.inputs["capture_tokens"]:
                con.execute(
                    "INSERT INTO emu_base SELECT ?, stream, pos, nll FROM cap", [frac]
                ).fetchall()
                self.results["dppl_base"][str(frac)] = "captured exact NLL"
            else:
                self.results["dppl_base"][str(frac)] = "none"

    def model_row(self, model: str) -> dict[str, Any]:
        """One row of `models.parquet`: the model's summary JSON (the embedded model's
        train_summary.json or a checkpoint's checkpoint.json), its geometry E / k / L (capture
        metadata first, then the summary) and the cache capacity C at every fraction run."""
        summary: dict[str, Any] = {}
        source = None
        for path in self.inputs["model_summary"]:  # one per model (split_by_model)
            summary = json.loads(Path(path).read_text())
            # results/{model}/model/train_summary.json or results/{model}/checkpoint.json
            source = "checkpoint" if Path(path).name == "checkpoint.json" else "embedded"
        config = summary.get("config") or {}
        meta = self.infos["capture_tokens"][0].meta if self.infos["capture_tokens"] else {}

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
            "top_k": first(
                meta.get("top_k"), summary.get("top_k"), config.get("num_experts_per_tok")
            ),  # fmt: skip
            "num_layers": first(meta.get("num_layers"), summary.get("num_layers")),
            "num_parameters": summary.get("num_parameters"),
            "heldout_perplexity": summary.get("heldout_perplexity"),
            "final_train_loss": summary.get("final_train_loss"),
            "train_tokens": summary.get("tokens_seen"),
            "train_time_s": summary.get("train_time_s"),
        }
        caps: dict[float, int | None] = {}
        for kind in ("simulate", "emulate", "engine"):
            for info in self.infos[kind]:
                cap = info.meta.get("capacity")
                if cap is None and num_experts is not None:
                    cap = capacity_for(info.fraction, int(num_experts))
                caps.setdefault(float(info.fraction), None if cap is None else int(cap))
        row["fractions"] = sorted(caps)
        row["capacities"] = [caps[f] for f in sorted(caps)]
        return row

    def provenance(self) -> list[dict[str, Any]]:
        out = []
        for kind in DATA_KINDS:
            for info in self.infos[kind]:
                meta = {k: info.meta[k] for k in PROVENANCE_KEYS if k in info.meta}
                out.append({"kind": kind, "path": info.path, "rows": info.rows, "metadata": meta})
        for kind in EXTRA_KINDS:
            for path in self.inputs[kind]:
                out.append({"kind": kind, "path": path, "rows": None, "metadata": {}})
        return out
