"""The embedded model's corpus and tokenizer: the running Python's standard library.

The corpus is the standard-library ``.py`` sources plus the English reference text of
``pydoc_data.topics`` (one document per topic). Excluded: test suites (any
``test``/``tests``/``idle_test`` directory, so a Debian-style Python without the test package
gives the same kind of corpus), ``site-packages``/``dist-packages``, ``__pycache__``, the
machine-specific ``_sysconfigdata*`` modules, machine-generated codec tables
(``encodings/cp*.py`` etc., marked "generated ... with gencodec.py"), ``pydoc_data/topics.py``
itself (its topics are separate documents) and files that are not valid UTF-8; ``idlelib`` is
kept (ordinary application code). Documents are
split into train / calib / eval by a sha256 hash of their stdlib-relative path, so the split
does not depend on the seed or on which other files exist. The tokenizer is a byte-level BPE
trained with ``tokenizers`` and wrapped as a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2

PYDOC_TOPICS = "pydoc_data/topics.py"
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
SPLITS = ("train", "calib", "eval")
# machine-generated data tables (the ~65 charmap codecs in `encodings`, 1.2 MB): near-identical
# boilerplate + byte tables that would dominate the held-out perplexity and the streams
GENERATED_MARKERS = ("with gencodec.py",)

# --------------------------------------------------------------------------------------------
# corpus


class SplitFractions(Protocol):
    """The document split's fractions (the rest is train); `moesub.embedded.EmbeddedConfig`
    has them."""

    calib_fraction: float
    eval_fraction: float


@dataclass(frozen=True)
class CorpusDoc:
    path: str  # stdlib-relative posix path; pydoc topics: "pydoc_data/topics.py#<topic>"
    package: str  # top-level package, or the module name of a top-level module
    split: str
    kind: str  # "code" | "text"
    nbytes: int


def stdlib_dir() -> Path:
    """The running Python's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(path: str, calib_fraction: float, eval_fraction: float) -> str:
    """Stable split of a document by the sha256 of its relative path."""
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") / 2.0**64
    if h < eval_fraction:
        return "eval"
    if h < eval_fraction + calib_fraction:
        return "calib"
    return "train"


def _package_of(rel: str) -> str:
    head = rel.split("#", 1)[0].split("/")
    return head[0] if len(head) > 1 else head[0].removesuffix(".py")


@functools.lru_cache(maxsize=4)
def _pydoc_topics(root: Path) -> dict[str, str]:
    """`pydoc_data.topics.topics` of the Python at `root` ({} when the module is absent)."""
    path = root / PYDOC_TOPICS
    if not path.is_file():
        return {}
    spec = importlib.util.spec_from_file_location("_moesub_pydoc_topics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    topics = getattr(module, "topics", {})
    return {str(k): str(v) for k, v in topics.items()}


def _code_files(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel != PYDOC_TOPICS:
                yield rel, full


def read_document(path: str, root: Path | None = None) -> str:
    """Text of a corpus document (as listed in corpus_files.parquet) from the stdlib at `root`."""
    root = stdlib_dir() if root is None else Path(root)
    if "#" in path:
        file, topic = path.split("#", 1)
        if file != PYDOC_TOPICS:
            raise ValueError(f"path: unknown corpus document {path!r}")
        topics = _pydoc_topics(root)
        if topic not in topics:
            raise FileNotFoundError(f"path: pydoc topic {topic!r} not in {root / PYDOC_TOPICS}")
        return topics[topic]
    full = root / path
    if not full.is_file():
        raise FileNotFoundError(f"path: corpus file {path!r} not found under {root}")
    return full.read_bytes().decode("utf-8")


def collect_corpus(
    cfg: SplitFractions, root: Path | None = None
) -> tuple[list[CorpusDoc], list[str]]:
    """All corpus documents (sorted by path) and their texts, with their split."""
    root = stdlib_dir() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"root: standard-library directory {root} does not exist")
    items: list[tuple[str, str, str]] = []  # (rel, kind, text)
    for rel, full in tqdm(list(_code_files(root)), desc="corpus: reading stdlib", unit="file"):
        try:
            text = full.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip() and not any(m in text[:2000] for m in GENERATED_MARKERS):
            items.append((rel, "code", text))
    for topic, text in _pydoc_topics(root).items():
        if text.strip():
            items.append((f"{PYDOC_TOPICS}#{topic}", "text", text))
    items.sort(key=lambda it: it[0])
    docs = [
        CorpusDoc(
            path=rel,
            package=_package_of(rel),
            split=split_of(rel, cfg.calib_fraction, cfg.eval_fraction),
            kind=kind,
            nbytes=len(text.encode()),
        )
        for rel, kind, text in items
    ]
    if not docs:
        raise FileNotFoundError(f"root: no usable .py sources under {root}")
    return docs, [text for _, _, text in items]


def corpus_table(docs: list[CorpusDoc]) -> dict[str, list]:
    return {
        "path": [d.path for d in docs],
        "split": [d.split for d in docs],
        "package": [d.package for d in docs],
        "kind": [d.kind for d in docs],
        "bytes": [d.nbytes for d in docs],
    }


# --------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, min_frequency: int = 2):
    """Byte-level BPE (`tokenizers`) wrapped as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    batches = [texts[i : i + 64] for i in range(0, len(texts), 64)]
    it = tqdm(batches, desc="tokenizer: training BPE", unit="batch")
    tok.train_from_iterator(it, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1_000_000,
    )


def encode_documents(tokenizer, texts: list[str], desc: str, sep_id: int | None) -> np.ndarray:
    """Concatenated token ids (int32) of `texts`, each followed by `sep_id` when given."""
    backend = tokenizer.backend_tokenizer
    parts: list[np.ndarray] = []
    for i in tqdm(range(0, len(texts), 256), desc=desc, unit="batch"):
        for enc in backend.encode_batch(texts[i : i + 256], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.int32))
            if sep_id is not None:
                parts.append(np.asarray([sep_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
