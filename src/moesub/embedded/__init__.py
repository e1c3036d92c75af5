"""The embedded default model: a tiny Qwen3-Next MoE trained here, on CPU, from the stdlib.

Everything the model needs ships with every Python installation:

- **corpus** (``moesub.corpus``): the running interpreter's standard-library ``.py`` sources
  plus the English reference text of ``pydoc_data.topics``, split into train / calib / eval by
  a hash of each document's path.
- **tokenizer** (``moesub.corpus``): byte-level BPE trained with ``tokenizers`` on the train
  split, saved as a ``PreTrainedTokenizerFast`` (``AutoTokenizer.from_pretrained`` loads it).
- **model**: transformers' own ``Qwen3NextForCausalLM`` (3 linear : 1 full attention, shared
  expert) with the reference model's routing geometry (512 routed experts, top-10, renormalized)
  and small widths, trained with AdamW + cosine under a token and/or wall-clock budget.

``build_model(out_dir, params)`` (this module) writes the HF checkpoint, tokenizer,
``train_log.parquet``, ``corpus_files.parquet`` and ``train_summary.json`` into ``out_dir``
atomically. The recipe is ``moesub.embedded.config`` (``EmbeddedConfig``, ``model_config``), the
training loop ``moesub.embedded.training``.

Determinism: corpus, split and tokenizer depend on the Python installation only; weights depend
on ``seed``, the torch thread count (``threads``; the pipeline fixes it) and the CPU kernels
(``moesub.cpu_kernels``; the pipeline pins them to AVX2 on x86-64). A run with only a token
budget (``max_tokens`` set, ``train_seconds=None``) is bit-reproducible (training runs with
torch's deterministic algorithms: the grouped_mm experts backward is otherwise thread-order
dependent). Under a wall-clock budget the cosine schedule follows the elapsed time, so the
number of steps (and the weights) vary with machine load; the steps, tokens and time actually
used are recorded in ``train_summary.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import platform
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moesub.corpus import (
    SPLITS,
    CorpusDoc,
    collect_corpus,
    corpus_table,
    encode_documents,
    stdlib_dir,
    train_tokenizer,
)
from moesub.cpu_kernels import kernel_facts
from moesub.embedded.config import EmbeddedConfig, model_config
from moesub.embedded.training import _deterministic, heldout_perplexity, train
from moesub.io import atomic_dir, write_json, write_parquet

# --------------------------------------------------------------------------------------------
# the pipeline entry point


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM (what schedulers send) into SystemExit so temp dirs get cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train_subset(docs: list[CorpusDoc], texts: list[str], max_bytes: int | None) -> list[str]:
    """Train-split texts; with `max_bytes`, a hash-ordered subset of about that size."""
    train = [(d, t) for d, t in zip(docs, texts, strict=True) if d.split == "train"]
    if max_bytes is None:
        return [t for _, t in train]
    train.sort(key=lambda dt: hashlib.sha256(b"subset:" + dt[0].path.encode()).digest())
    out, total = [], 0
    for doc, text in train:
        if total >= max_bytes:
            break
        out.append(text)
        total += doc.nbytes
    return out


def build_model(out_dir: str | os.PathLike, params: dict[str, Any] | None = None) -> Path:
    """Build the embedded default model into `out_dir` (atomically); returns `out_dir`.

    Writes the HF checkpoint (config.json, model.safetensors), the tokenizer files,
    train_log.parquet, corpus_files.parquet and train_summary.json.
    """
    cfg = EmbeddedConfig.from_params(params)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(out_dir)
    wall0 = time.perf_counter()
    docs, texts = collect_corpus(cfg)
    train_texts = _train_subset(docs, texts, cfg.train_max_bytes)
    eval_texts = [t for d, t in zip(docs, texts, strict=True) if d.split == "eval"]
    for split, items in (("train", train_texts), ("eval", eval_texts)):
        if not items:
            raise ValueError(f"corpus: the {split} split is empty; adjust the split fractions")

    with _sigterm_raises(), atomic_dir(out) as tmp:
        corpus_meta = {"stdlib": str(stdlib_dir()), "python": platform.python_version()}
        write_parquet(corpus_table(docs), tmp / "corpus_files.parquet", metadata=corpus_meta)
        tokenizer = train_tokenizer(train_texts, cfg.vocab_size, cfg.min_frequency)
        if len(tokenizer) != cfg.vocab_size:
            raise ValueError(
                f"params: vocab_size={cfg.vocab_size} but the corpus only supports "
                f"{len(tokenizer)} tokens"
            )
        tokenizer.save_pretrained(tmp)
        eos = tokenizer.eos_token_id
        train_ids = encode_documents(tokenizer, train_texts, "tokenizing train", eos)
        eval_ids = encode_documents(tokenizer, eval_texts, "tokenizing eval", eos)

        from transformers import Qwen3NextForCausalLM

        torch.manual_seed(cfg.seed)
        model = Qwen3NextForCausalLM(model_config(cfg, tokenizer))
        n_params = sum(p.numel() for p in model.parameters())
        with _deterministic(cfg.deterministic):
            log, facts = train(model, train_ids, cfg)
        write_parquet(log, tmp / "train_log.parquet", metadata={"config": dataclasses.asdict(cfg)})
        ppl = heldout_perplexity(model, eval_ids, cfg.seq_len, cfg.eval_tokens)
        model.save_pretrained(tmp)
        summary = {
            "config": dataclasses.asdict(cfg),
            **facts,
            "tokens_per_s": facts["tokens_seen"] / max(facts["train_time_s"], 1e-9),
            "final_train_loss": log["loss"][-1] if log["loss"] else None,
            "heldout_perplexity": ppl["perplexity"],
            "heldout_nll": ppl["nll"],
            "heldout_tokens": ppl["tokens"],
            "num_parameters": n_params,
            "corpus": {
                s: {
                    "files": sum(d.split == s for d in docs),
                    "bytes": sum(d.nbytes for d in docs if d.split == s),
                }
                for s in SPLITS
            },
            "train_corpus_tokens": int(train_ids.size),
            "eval_corpus_tokens": int(eval_ids.size),
            "python": platform.python_version(),
            "stdlib": str(stdlib_dir()),
            "cpu_kernels": kernel_facts(),  # what the bits depend on beyond the pins
            "torch": torch.__version__,
            "build_seconds": time.perf_counter() - wall0,
        }
        write_json(summary, tmp / "train_summary.json")
    return out
