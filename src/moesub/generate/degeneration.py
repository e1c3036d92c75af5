"""Degeneration of one generated token sequence: how much it repeats itself, and whether it ends
in a loop. Every measure reads token ids (the model's own units), never the decoded text.

- `repeated_ngram_share(tokens, 4)`: the share of the sequence's n-grams (n - 3 of them for
  4-grams) that repeat an n-gram seen earlier in it, `1 - distinct / total` (Welleck et al.
  2019's seq-rep-4); NaN when the sequence is shorter than n.
- `longest_repeat(tokens)`: the length of the longest token span that occurs at least twice in
  the sequence (the occurrences may overlap: `a b a b a` repeats `a b a`); 0 when no token
  repeats.
- `tail_loop(tokens, window, max_period)`: the sequence *ends in a loop* when its last `window`
  tokens are periodic with a period p <= `max_period`: `t[i] == t[i - p]` for each of the last
  `window - p` positions, i.e. the tail is `window / p` (>= 2) repetitions of one p-token cycle
  (the smallest such p is the loop's period). The loop's length is then the longest suffix that
  has that period (it may reach back before the window): how long the model has been looping.

`DEGENERATION_MEASURES` names the measures one sequence gets (`measures`), as they are stored
in a generation artefact's `measures` column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

REP_N = 4  # the n of the repeated n-gram share
# name -> what it is, for artefacts and the statistics
DEGENERATION_MEASURES = {
    "rep4": "share of repeated 4-grams",
    "longest_repeat": "longest repeated span (tokens)",
    "ends_in_loop": "ends in a loop (1) or not (0)",
    "loop_period": "the loop's period in tokens (NaN: no loop)",
    "loop_tokens": "the looping suffix's length in tokens (0: no loop)",
}


def _tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {arr.shape}")
    return arr


def repeated_ngram_share(tokens: Sequence[int] | np.ndarray, n: int = REP_N) -> float:
    """Share of the n-grams that repeat an earlier one (`1 - distinct / total`; module doc)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    t = _tokens(tokens)
    total = len(t) - n + 1
    if total < 1:
        return float("nan")
    grams = np.lib.stride_tricks.sliding_window_view(t, n)  # (total, n)
    return 1.0 - len(np.unique(grams, axis=0)) / total


def _longest_true_run(mask: np.ndarray) -> int:
    """Length of the longest run of True in a 1-D bool array."""
    if not mask.any():
        return 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return int((edges[1::2] - edges[0::2]).max())


def longest_repeat(tokens: Sequence[int] | np.ndarray) -> int:
    """Length of the longest span occurring at least twice, overlaps allowed (module doc).

    A span of length m at positions i and i + d is a run of m equalities `t[j] == t[j + d]`;
    every shift d is tried (a shift can give at most len - d, so the search stops early)."""
    t = _tokens(tokens)
    best = 0
    for d in range(1, len(t)):
        if len(t) - d <= best:
            break
        best = max(best, _longest_true_run(t[:-d] == t[d:]))
    return best


@dataclass(frozen=True)
class Loop:
    """Whether a sequence ends in a loop, its smallest period and how long it has looped."""

    ends_in_loop: bool
    period: int | None  # None: no loop
    tokens: int  # length of the suffix with that period (0: no loop)


def check_loop_definition(window: int, max_period: int) -> None:
    """A loop needs at least two full cycles in the window: 1 <= max_period <= window / 2."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 2:
        raise ValueError(f"loop_window must be an integer >= 2, got {window!r}")
    if (
        isinstance(max_period, bool)
        or not isinstance(max_period, (int, np.integer))
        or not 1 <= max_period <= window // 2
    ):
        raise ValueError(
            f"loop_max_period must be an integer in [1, loop_window / 2 = {window // 2}] (a "
            f"loop is at least two cycles within the window), got {max_period!r}"
        )


def tail_loop(tokens: Sequence[int] | np.ndarray, window: int, max_period: int) -> Loop:
    """Whether the last `window` tokens repeat a cycle of at most `max_period` (module doc); a
    sequence shorter than `window` does not end in a loop."""
    check_loop_definition(window, max_period)
    t = _tokens(tokens)
    if len(t) < window:
        return Loop(False, None, 0)
    tail = t[len(t) - window :]
    for p in range(1, max_period + 1):
        if np.array_equal(tail[p:], tail[:-p]):
            differ = np.flatnonzero(t[p:] != t[:-p])  # j: t[j + p] != t[j]
            start = int(differ[-1]) + 1 if differ.size else 0  # the suffix from here has period p
            return Loop(True, p, len(t) - start)
    return Loop(False, None, 0)


def measures(tokens: Sequence[int] | np.ndarray, window: int, max_period: int) -> dict[str, float]:
    """Every measure of `DEGENERATION_MEASURES` for one sequence (floats; NaN: undefined)."""
    loop = tail_loop(tokens, window, max_period)
    return {
        "rep4": repeated_ngram_share(tokens, REP_N),
        "longest_repeat": float(longest_repeat(tokens)),
        "ends_in_loop": float(loop.ends_in_loop),
        "loop_period": float(loop.period) if loop.period is not None else float("nan"),
        "loop_tokens": float(loop.tokens),
    }
