"""The evaluation and calibration documents of a configured text source (config
``streams: source:``): what the streams stage cuts into token streams and the generation stage's
continuation task takes its prompts from.

Sources (``source`` dict):

- ``{"kind": "embedded"}``: the eval / calib documents recorded in the model directory's
  ``corpus_files.parquet`` (embedded default model), read from the running Python's stdlib
  (``root`` overrides the stdlib directory). Package = stdlib top-level package / module.
- ``{"kind": "text", "path": FILE}``: a local file for a real checkpoint. ``.txt``: documents
  separated by blank lines or form feeds; ``.jsonl`` (or ``.jsonl.gz``): one JSON object per line
  with a ``field`` (default ``"text"``); ``.parquet``: a ``field`` column. Optional
  ``package_field`` (jsonl / parquet) groups documents into packages; without it every
  document is its own package. Calibration documents come from ``calib_path`` when given, else
  a ``calib_fraction`` (default 0.25) of the documents chosen by a sha256 hash of their text.
- ``{"kind": "datasets", "name": ..., "split": "test", "field": "text"}``: a Hugging Face
  ``datasets`` dataset (``config``, ``package_field``, ``calib_split`` / ``calib_fraction``
  optional). ``name`` may be a directory written by ``Dataset.save_to_disk`` (works offline);
  a hub name needs network access and fails with a clear error offline.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from moesub.corpus import read_document, stdlib_dir

_SOURCE_KEYS = {
    "embedded": {"kind", "root"},
    "text": {"kind", "path", "field", "package_field", "calib_path", "calib_fraction"},
    "datasets": {
        "kind", "name", "config", "split", "field", "package_field", "calib_split",
        "calib_fraction",
    },
}  # fmt: skip


@dataclass(frozen=True)
class Document:
    name: str  # where it came from (stdlib path, file:index, dataset:split:index)
    package: str  # documents of one package share a topic
    text: str


def check_source(source: dict[str, Any]) -> str:
    """Validate a source dict; returns its kind."""
    if not isinstance(source, dict) or "kind" not in source:
        raise ValueError(f"source: must be a mapping with a 'kind', got {source!r}")
    kind = source["kind"]
    if kind not in _SOURCE_KEYS:
        raise ValueError(f"source: unknown kind {kind!r} (known: {sorted(_SOURCE_KEYS)})")
    for key in source:
        if key not in _SOURCE_KEYS[kind]:
            raise ValueError(f"source: unknown key {key!r} for kind {kind!r}")
    required = {"text": ("path",), "datasets": ("name",)}.get(kind, ())
    for key in required:
        if not source.get(key):
            raise ValueError(f"source: kind {kind!r} needs {key!r}")
    frac = source.get("calib_fraction", 0.25)
    if not 0 < frac < 1:
        raise ValueError(f"source: calib_fraction must be in (0, 1), got {frac!r}")
    if kind == "text":
        for key in ("path", "calib_path"):
            if source.get(key) is not None and not Path(source[key]).is_file():
                raise FileNotFoundError(f"source: {key} {source[key]!r} is not a file")
    return kind


def _hash_unit(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def _hash_split(docs: list[Document], calib_fraction: float) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {"eval": [], "calib": []}
    for doc in docs:
        out["calib" if _hash_unit(doc.text) < calib_fraction else "eval"].append(doc)
    return out


def _records_to_docs(
    records: list[dict], label: str, text_field: str, package_field: str | None
) -> list[Document]:
    docs = []
    for i, rec in enumerate(records):
        if text_field not in rec:
            raise ValueError(f"source: {label} record {i} has no field {text_field!r}")
        text = rec[text_field]
        if not isinstance(text, str) or not text.strip():
            continue
        name = f"{label}:{i}"
        package = name
        if package_field is not None:
            if package_field not in rec:
                raise ValueError(f"source: {label} record {i} has no field {package_field!r}")
            package = str(rec[package_field])
        docs.append(Document(name=name, package=package, text=text))
    return docs


def read_text_file(
    path: str | os.PathLike, text_field: str = "text", package_field: str | None = None
) -> list[Document]:
    """Documents of a local .txt / .jsonl(.gz) / .parquet file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: {path} is not a file")
    name = path.name
    if name.endswith(".txt"):
        if package_field is not None:
            raise ValueError("source: package_field is not supported for .txt files")
        parts = re.split(r"\f|\n[ \t]*\n", path.read_text(encoding="utf-8"))
        texts = [p.strip("\n") for p in parts]
        return [
            Document(name=f"{name}:{i}", package=f"{name}:{i}", text=t)
            for i, t in enumerate(texts)
            if t.strip()
        ]
    if name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        records = []
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"path: {path} line {lineno} is not JSON: {e}") from e
        return _records_to_docs(records, name, text_field, package_field)
    if name.endswith(".parquet"):
        columns = [text_field] + ([package_field] if package_field else [])
        schema_names = pq.read_schema(path).names
        for col in columns:
            if col not in schema_names:
                raise ValueError(f"path: {path} has no column {col!r} (columns: {schema_names})")
        records = pq.read_table(path, columns=columns).to_pylist()
        return _records_to_docs(records, name, text_field, package_field)
    raise ValueError(f"path: {path}: expected a .txt, .jsonl, .jsonl.gz or .parquet file")


def _load_dataset(name: str, config: str | None, split: str):
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise RuntimeError("source: kind 'datasets' needs the `datasets` package") from e
    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"source: dataset at {name} has no split {split!r}")
            ds = ds[split]
        return ds
    try:
        return datasets.load_dataset(name, config, split=split)
    except (ConnectionError, OSError) as e:
        raise RuntimeError(
            f"source: could not load dataset {name!r} (config {config!r}, split {split!r}) from "
            f"the Hugging Face hub: {type(e).__name__}: {e}. This machine may be offline: save "
            "the dataset with `Dataset.save_to_disk` and pass that directory as `name`, or use "
            "a {'kind': 'text', 'path': ...} source with a local .txt/.jsonl/.parquet file."
        ) from e


def _dataset_docs(source: dict[str, Any], split: str) -> list[Document]:
    ds = _load_dataset(source["name"], source.get("config"), split)
    text_field = source.get("field", "text")
    package_field = source.get("package_field")
    columns = [text_field] + ([package_field] if package_field else [])
    for col in columns:
        if col not in ds.column_names:
            raise ValueError(f"source: dataset has no column {col!r} ({ds.column_names})")
    records = ds.select_columns(columns).to_list()
    return _records_to_docs(records, f"{source['name']}:{split}", text_field, package_field)


def load_documents(model_dir: Path, source: dict[str, Any]) -> dict[str, list[Document]]:
    """The eval and calib documents of a source, in a deterministic order."""
    kind = check_source(source)
    frac = source.get("calib_fraction", 0.25)
    if kind == "embedded":
        table_path = model_dir / "corpus_files.parquet"
        if not table_path.is_file():
            raise FileNotFoundError(
                f"model_dir: {table_path} not found; a source of kind 'embedded' needs the "
                "embedded default model (moesub.embedded.build_model)"
            )
        root = Path(source["root"]) if source.get("root") else stdlib_dir()
        rows = pq.read_table(table_path, columns=["path", "split", "package"]).to_pylist()
        out: dict[str, list[Document]] = {"eval": [], "calib": []}
        for row in sorted(rows, key=lambda r: r["path"]):
            if row["split"] in out:
                text = read_document(row["path"], root)
                out[row["split"]].append(Document(row["path"], row["package"], text))
        return out
    if kind == "text":
        text_field = source.get("field", "text")
        docs = read_text_file(source["path"], text_field, source.get("package_field"))
        if source.get("calib_path"):
            calib = read_text_file(source["calib_path"], text_field, source.get("package_field"))
            return {"eval": docs, "calib": calib}
        return _hash_split(docs, frac)
    # datasets
    split = source.get("split", "test")
    docs = _dataset_docs(source, split)
    if source.get("calib_split"):
        return {"eval": docs, "calib": _dataset_docs(source, source["calib_split"])}
    return _hash_split(docs, frac)
