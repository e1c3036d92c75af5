"""Evaluation and calibration token streams with topic changes at known positions.

A stream is a concatenation of document pieces: each piece is the first tokens of one document
(at most ``doc_tokens_max``), and consecutive pieces come from different packages (as far as
the source allows, a stream never repeats a package), so every ``doc_start`` row marks a topic
change. No separator token is inserted between pieces. Each document is used at most once per
split. Output columns: ``stream:int32, pos:int32, token_id:int32, doc_id:int32, doc_start:bool``;
the Parquet metadata ``docs`` lists every piece (doc_id, name, package, stream, start, tokens).

Sources (``source`` dict, config ``streams: source:``):

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

import dataclasses
import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from moesub.artefacts import STREAM_SCHEMA
from moesub.config import schema_defaults
from moesub.io import write_parquet

_SPLIT_CODES = {"eval": 0, "calib": 1}
_SOURCE_KEYS = {
    "embedded": {"kind", "root"},
    "text": {"kind", "path", "field", "package_field", "calib_path", "calib_fraction"},
    "datasets": {
        "kind", "name", "config", "split", "field", "package_field", "calib_split",
        "calib_fraction",
    },
}  # fmt: skip


_DEFAULTS = schema_defaults("streams")  # workflow/schemas/config.schema.yaml


@dataclass
class SplitSpec:
    n_streams: int
    stream_len: int = schema_defaults("streams.eval")["stream_len"]


def _split_default(split: str) -> SplitSpec:
    return SplitSpec(**schema_defaults(f"streams.{split}"))


@dataclass
class StreamsConfig:
    """`params` of `build_streams` (config.yaml ``streams:`` section, minus ``source``)."""

    eval: SplitSpec = field(default_factory=lambda: _split_default("eval"))
    calib: SplitSpec = field(default_factory=lambda: _split_default("calib"))
    # a document contributes at most this many tokens
    doc_tokens_max: int = _DEFAULTS["doc_tokens_max"]
    doc_tokens_min: int = _DEFAULTS["doc_tokens_min"]  # documents shorter than this are skipped
    seed: int = _DEFAULTS["seed"]

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> StreamsConfig:
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in params:
            if key not in known:
                raise ValueError(f"params: unknown streams key {key!r} (known: {sorted(known)})")
        cfg = cls()
        for name in ("eval", "calib"):
            if name in params:
                sub = params.pop(name)
                if not isinstance(sub, dict):
                    raise ValueError(f"params: {name} must be a mapping, got {sub!r}")
                for key in sub:
                    if key not in ("n_streams", "stream_len"):
                        raise ValueError(f"params: unknown key {name}.{key!r}")
                setattr(cfg, name, dataclasses.replace(getattr(cfg, name), **sub))
        cfg = dataclasses.replace(cfg, **params)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("eval", "calib"):
            spec = getattr(self, name)
            for key in ("n_streams", "stream_len"):
                value = getattr(spec, key)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"params: {name}.{key} must be an int >= 1, got {value!r}")
        for key in ("doc_tokens_max", "doc_tokens_min"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"params: {key} must be an int >= 1, got {value!r}")
        if self.doc_tokens_min > self.doc_tokens_max:
            raise ValueError("params: doc_tokens_min must be <= doc_tokens_max")
        if not isinstance(self.seed, int):
            raise ValueError(f"params: seed must be an int, got {self.seed!r}")


@dataclass(frozen=True)
class Document:
    name: str  # where it came from (stdlib path, file:index, dataset:split:index)
    package: str  # documents of one package share a topic
    text: str


# --------------------------------------------------------------------------------------------
# sources


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
        import pyarrow.parquet as pq

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
        import pyarrow.parquet as pq

        from moesub.corpus import read_document, stdlib_dir

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


# --------------------------------------------------------------------------------------------
# stream assembly


class _LazyTokens:
    """Token ids of documents, encoded in batches on first use (only what the streams need)."""

    def __init__(self, tokenizer, docs: list[Document], order: np.ndarray, vocab: int, cap: int):
        self.tokenizer, self.docs, self.order, self.vocab, self.cap = (
            tokenizer,
            docs,
            order,
            vocab,
            cap,
        )
        self.rank = np.empty(len(order), dtype=np.int64)
        self.rank[order] = np.arange(len(order))
        self.cache: dict[int, np.ndarray] = {}

    def __call__(self, i: int) -> np.ndarray:
        if i not in self.cache:
            r = int(self.rank[i])
            batch = [int(j) for j in self.order[r : r + 32] if int(j) not in self.cache]
            enc = self.tokenizer(
                [self.docs[j].text for j in batch], add_special_tokens=False, verbose=False
            )["input_ids"]
            for j, ids in zip(batch, enc, strict=True):
                arr = np.asarray(ids[: self.cap], dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= self.vocab):
                    raise ValueError(
                        f"tokenizer: document {self.docs[j].name!r} has token ids outside "
                        f"[0, {self.vocab}) (min {arr.min()}, max {arr.max()})"
                    )
                self.cache[j] = arr.astype(np.int32)
        return self.cache[i]


def assemble_streams(
    docs: list[Document], tokens_of, order: np.ndarray, spec: SplitSpec, cfg: StreamsConfig
) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """Concatenate document pieces into `spec.n_streams` streams of `spec.stream_len` tokens.

    Documents are taken in `order`; the next piece is the first unused document whose package
    is not yet in the stream (falling back to one that differs from the previous piece's).
    """
    used = np.zeros(len(docs), dtype=bool)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in STREAM_SCHEMA.names}
    pieces: list[dict[str, Any]] = []
    start = 0  # first position in `order` that may still be unused
    bar = tqdm(total=spec.n_streams * spec.stream_len, desc="streams", unit="tok", mininterval=1)
    for s in range(spec.n_streams):
        filled, prev, seen = 0, None, set()
        while filled < spec.stream_len:
            while start < len(order) and used[order[start]]:
                start += 1
            pick, fallback = None, None
            for r in range(start, len(order)):
                j = int(order[r])
                if used[j]:
                    continue
                if len(tokens_of(j)) < cfg.doc_tokens_min:
                    used[j] = True  # too short to be a topic segment: never use it
                    continue
                pkg = docs[j].package
                if pkg not in seen:
                    pick = j
                    break
                if fallback is None and pkg != prev:
                    fallback = j
            pick = pick if pick is not None else fallback
            if pick is None:
                raise ValueError(
                    f"source: not enough documents ({len(docs)}, from "
                    f"{len({d.package for d in docs})} packages, at least "
                    f"{cfg.doc_tokens_min} tokens each) for {spec.n_streams} streams of "
                    f"{spec.stream_len} tokens with consecutive documents from different "
                    f"packages; stream {s} stopped at {filled} tokens"
                )
            used[pick] = True
            ids = tokens_of(pick)[: min(cfg.doc_tokens_max, spec.stream_len - filled)]
            n, doc_id = len(ids), len(pieces)
            cols["stream"].append(np.full(n, s, dtype=np.int32))
            cols["pos"].append(np.arange(filled, filled + n, dtype=np.int32))
            cols["token_id"].append(ids.astype(np.int32))
            cols["doc_id"].append(np.full(n, doc_id, dtype=np.int32))
            cols["doc_start"].append(np.arange(n) == 0)
            pieces.append(
                {
                    "doc_id": doc_id,
                    "name": docs[pick].name,
                    "package": docs[pick].package,
                    "stream": s,
                    "start": filled,
                    "tokens": n,
                }
            )
            filled += n
            prev = docs[pick].package
            seen.add(prev)
            bar.update(n)
    bar.close()
    return {k: np.concatenate(v) for k, v in cols.items()}, pieces


def _model_vocab(model_dir: Path, tokenizer) -> int:
    """Ids must index both the tokenizer and the model's embedding (config vocab_size)."""
    vocab = len(tokenizer)
    config = model_dir / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        size = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
        if size:
            vocab = min(vocab, int(size))
    return vocab


def build_streams(
    model_dir: str | os.PathLike,
    source: dict[str, Any],
    params: dict[str, Any] | None,
    out_eval: str | os.PathLike,
    out_calib: str | os.PathLike,
) -> tuple[Path, Path]:
    """Write the eval and calib stream Parquet files (schema `STREAM_SCHEMA`)."""
    cfg = StreamsConfig.from_params(params)
    check_source(source)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model_dir: {model_dir} is not a directory")
    from moesub.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)  # a missing or empty tokenizer says so
    vocab = _model_vocab(model_dir, tokenizer)
    documents = load_documents(model_dir, source)
    outputs = {"eval": Path(out_eval), "calib": Path(out_calib)}
    tables = {}
    for split in outputs:  # assemble both before writing either: no half-written pair
        docs = documents[split]
        spec: SplitSpec = getattr(cfg, split)
        rng = np.random.default_rng([cfg.seed, _SPLIT_CODES[split]])
        order = rng.permutation(len(docs))
        tokens_of = _LazyTokens(tokenizer, docs, order, vocab, cfg.doc_tokens_max)
        cols, pieces = assemble_streams(docs, tokens_of, order, spec, cfg)
        meta = {
            "split": split,
            "docs": pieces,
            "source": source,
            "params": dataclasses.asdict(cfg),
            "model_dir": str(model_dir),
            "vocab_size": vocab,
        }
        tables[split] = (pa.table(cols, schema=STREAM_SCHEMA), meta)
    for split, out in outputs.items():
        write_parquet(tables[split][0], out, metadata=tables[split][1])
    return outputs["eval"], outputs["calib"]
