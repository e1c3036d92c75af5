"""What every generation task shares: the task record, problems, scores, subsampling, the stop
cut, agreement."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moesub.generate.params import GenerateParams


@dataclass
class TaskItem:
    """One problem ready to decode and score: a text prompt, or token ids (`prompt_ids`) when
    the prompt is cut at a token boundary of a tokenized document (code completion)."""

    problem_id: str
    prompt: str
    target: str
    problem: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Score:
    """One stop-cut output, scored: whether it is correct (None: not scored, `missing` says
    why, e.g. the sandbox itself failed; None with no `missing`: the task grades no answer, as
    the free continuation), what was predicted (GSM8K: the extracted number; HumanEval: the
    run's status; code completion: the normalized line; continuation: the loop, if any) and
    the task's numeric measures of it (name -> value, NaN: undefined; continuation: its
    degeneration, `moesub.generate.degeneration`)."""

    correct: bool | None
    prediction: str
    missing: str = ""
    measures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One generation task as a record: the stage asks it for its problems, where decoding and
    scoring stop, and how an output is scored; no other code knows a task by name. Each task's
    module defines its record; `moesub.generate.tasks.TASKS` lists them."""

    name: str  # the config's generate.tasks key and the artefacts' `task`
    # (data_path, model_dir, options) -> the problems; FileNotFoundError with a how-to when the
    # data is missing (the stage then writes an empty artefact that says so)
    items: Callable[[str | os.PathLike | None, str | os.PathLike, GenerateParams], list[TaskItem]]
    stops: tuple[str, ...]  # the decoded output is cut at the first of these before scoring
    # (item, stop-cut output, its tokens, options) -> the output's Score
    score: Callable[[TaskItem, str, Sequence[int], GenerateParams], Score]
    # tokenizer -> tokens that end decoding besides end-of-text (None: end-of-text only)
    stop_tokens: Callable[[Any], set[int]] | None = None
    sandboxed: bool = False  # scoring runs generated code: the artefact records the isolation
    # every prompt has the same length and decoding runs max_new_tokens with no stop at all (not
    # even end of text): the stage decodes the prompts in batches on the emulator
    # (`moesub.greedy.greedy_decode_batched`), since what is measured is the text, not time
    fixed_length: bool = False

    def stop_ids(self, tokenizer) -> set[int]:
        """The token ids that end decoding: end of text, and the task's own stop tokens (none
        for a fixed-length task)."""
        if self.fixed_length:
            return set()
        stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        if self.stop_tokens is not None:
            stop |= self.stop_tokens(tokenizer)
        return stop


def subsample(items: list, n: int, seed: int, what: str) -> list:
    """`n` of `items` (without replacement, seeded), in their original order."""
    if n > len(items):
        raise ValueError(f"n={n} exceeds the {len(items)} {what} available")
    idx = np.sort(np.random.default_rng(seed).choice(len(items), size=n, replace=False))
    return [items[i] for i in idx]


def truncate_at(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop sequence."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def scored_length(tokenizer, tokens: Sequence[int], n_chars: int) -> int:
    """How many of `tokens` it takes to cover the first `n_chars` characters of their decoded
    text: the generated tokens that the (stop-cut) score saw; agreement compares these."""
    for m in range(len(tokens) + 1):
        if len(tokenizer.decode(tokens[:m], skip_special_tokens=True)) >= n_chars:
            return m
    return len(tokens)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> tuple[bool, float]:
    """(exact match, common-prefix length / length of the longer sequence; 1.0 if both empty)."""
    a = np.asarray(tokens, dtype=np.int64)
    b = np.asarray(reference, dtype=np.int64)
    longer = max(len(a), len(b))
    if longer == 0:
        return True, 1.0
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    prefix = int(diff[0]) if diff.size else m
    return bool(len(a) == len(b) and prefix == m), prefix / longer
