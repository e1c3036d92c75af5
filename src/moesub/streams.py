"""Evaluation and calibration token streams with topic changes at known positions.

A stream is a concatenation of document pieces: each piece is the first tokens of one document
(at most ``doc_tokens_max``), and consecutive pieces come from different packages (as far as
the source allows, a stream never repeats a package), so every ``doc_start`` row marks a topic
change. No separator token is inserted between pieces. Each document is used at most once per
split. Output columns: ``stream:int32, pos:int32, token_id:int32, doc_id:int32, doc_start:bool``;
the Parquet metadata ``docs`` lists every piece (doc_id, name, package, stream, start, tokens).

Sources (``source`` dict, config ``streams: source:``): `moesub.documents`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from moesub.artefacts import STREAM_SCHEMA
from moesub.config import schema_defaults
from moesub.documents import Document, check_source, load_documents
from moesub.io import write_parquet

_SPLIT_CODES = {"eval": 0, "calib": 1}
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
