"""Held-out standard-library code completion: given a file's code up to a point in a line,
greedily generate the rest of the line; correct when it equals the file's text up to the end of
the line after whitespace normalization (runs of whitespace collapsed to one space, ends
stripped).

Files: the held-out (`eval`) split of the embedded corpus as recorded in the model's
`corpus_files.parquet` (`moesub.embedded` splits documents by a hash of their path; the
model never trained on them), `.py` files only, read from the running Python's standard library.
A table of the same format can be given as the task's `path` (e.g. for a checkpoint that was
not built here); a model without one reports the task as missing data.

Lines: a candidate is a line where a line of code starts, per Python's own tokenizer: its first
token is code (not a comment, not a string: docstrings and string-only lines are excluded, and
so are lines inside a multi-line string), it has at least `min_line_chars` non-blank characters
after normalization, and it is at most `max_line_tokens` tokens long. `n` candidates are drawn
from all held-out files together (seeded, without replacement) and kept in (file, line) order.

Cut: each file is tokenized whole, as in training, and the prompt ends at a token boundary of
the file's own tokenization, so the model continues exactly where the file's tokens continue.
With `line_cut: random` (the default) the cut falls after 1 to m-1 of the line's m tokens
(lines of at least 2 tokens), chosen by a sha256 hash of (seed, file, line): the prompt holds
the start of the line, the target is the rest (line-level completion as in CodeXGLUE's Python
line completion). With `line_cut: start` the prompt ends just before the line's first
non-blank character (its indentation token stays in the prompt) and the whole line is the
target: the default embedded model reproduces only ~1.5% of whole lines exactly, too few for
policy differences to show. The prompt is the last `max_prompt_tokens` tokens before the cut.
Decoding stops at the first token that holds a newline (the stop cut: one line).
"""

from __future__ import annotations

import hashlib
import io
import os
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from moesub.corpus import read_document
from moesub.generate.base import Score, Task, TaskItem
from moesub.generate.params import GenerateParams

COMPLETION_STOP = ("\n",)
LINE_CUTS = ("random", "start")
_SKIP_TOKENS = frozenset(
    {
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.COMMENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
)
_TEXT_TOKENS = frozenset({tokenize.STRING, getattr(tokenize, "FSTRING_START", tokenize.STRING)})


def normalize_line(text: str) -> str:
    """Whitespace-normalized line: runs of whitespace become one space, ends stripped."""
    return " ".join(text.split())


def code_line_starts(text: str) -> list[int]:
    """0-based numbers of the lines whose first token is code (see the module docstring);
    [] when Python's tokenizer rejects the file."""
    lines = text.splitlines(keepends=True)
    first: dict[int, tuple[int, int]] = {}  # row (1-based) -> (token type, column)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in _SKIP_TOKENS and tok.start[0] not in first:
                first[tok.start[0]] = (tok.type, tok.start[1])
    except (tokenize.TokenError, SyntaxError):
        return []
    out = []
    for row, (kind, col) in sorted(first.items()):
        line = lines[row - 1] if row <= len(lines) else ""
        # the token must open the line (not follow the end of a multi-line string)
        if kind not in _TEXT_TOKENS and col == len(line) - len(line.lstrip()):
            out.append(row - 1)
    return out


@dataclass(frozen=True)
class CompletionProblem:
    problem_id: str  # "<stdlib-relative path>:<1-based line number>"
    prompt_ids: list[int]
    target: str  # the file's text from the cut to the end of the line


def _file_problems(
    path: str,
    text: str,
    tokenizer,
    context_tokens: int | None,
    min_line_chars: int,
    max_line_tokens: int,
    line_cut: str,
    seed: int,
) -> list[CompletionProblem]:
    if line_cut not in LINE_CUTS:
        raise ValueError(f"line_cut must be one of {LINE_CUTS}, got {line_cut!r}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    ends = np.asarray([e for _, e in enc["offset_mapping"]], dtype=np.int64)  # (T,)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)  # (T,)
    line_offsets = np.cumsum([0] + [len(x) for x in text.splitlines(keepends=True)])
    out = []
    for row in code_line_starts(text):
        line = text[line_offsets[row] : line_offsets[row + 1]]
        body = line.rstrip("\r\n")
        if len(normalize_line(body)) < min_line_chars:
            continue
        code_start = int(line_offsets[row]) + len(body) - len(body.lstrip())
        line_end = int(line_offsets[row]) + len(body)
        j = int(np.searchsorted(ends, code_start, side="right"))  # tokens ending <= code_start
        n_line = int(np.searchsorted(starts, line_end, side="left")) - j
        if j == 0 or n_line > max_line_tokens or (line_cut == "random" and n_line < 2):
            continue
        cut = j + (0 if line_cut == "start" else 1 + _hash(seed, path, row) % (n_line - 1))
        lo = 0 if context_tokens is None else max(0, cut - context_tokens)
        target = text[int(ends[cut - 1]) : line_end]
        out.append(CompletionProblem(f"{path}:{row + 1}", list(ids[lo:cut]), target))
    return out


def _hash(seed: int, path: str, row: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}:{row}".encode()).digest()[:8], "big")


def heldout_code_files(corpus_table: str | os.PathLike) -> list[str]:
    """The held-out (`eval` split) `.py` files of a corpus_files.parquet, sorted; refuses a
    table whose eval split would include a training file."""
    rows = pq.read_table(corpus_table, columns=["path", "split", "kind"]).to_pylist()
    train = {r["path"] for r in rows if r["split"] == "train"}
    files = sorted(r["path"] for r in rows if r["split"] == "eval" and r["kind"] == "code")
    if train & set(files):
        raise ValueError(
            f"{corpus_table}: file(s) {sorted(train & set(files))[:3]} are in both "
            "the train and the eval split"
        )
    if not files:
        raise FileNotFoundError(f"{corpus_table}: no held-out (eval split) code files")
    return files


def corpus_table_path(data_path: str | os.PathLike | None, model_dir: str | os.PathLike) -> Path:
    """The corpus table: `data_path` if given, else the model's corpus_files.parquet."""
    path = Path(data_path) if data_path else Path(model_dir) / "corpus_files.parquet"
    if not path.is_file():
        raise FileNotFoundError(
            f"code completion: corpus table {str(path)!r} does not exist; the task needs the "
            "held-out split of the model's training corpus (the embedded model writes "
            "corpus_files.parquet); for another model set generate.tasks.code_completion.path "
            "to a table of the same format (path, split, kind)"
        )
    return path


def completion_items(
    data_path: str | os.PathLike | None, model_dir: str | os.PathLike, opts: GenerateParams
) -> list[TaskItem]:
    """`opts.n` held-out lines to complete, cut by the model's own tokenizer (the context is
    `opts.max_prompt_tokens`; FileNotFoundError when the corpus table is missing)."""
    files = heldout_code_files(corpus_table_path(data_path, model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    candidates: list[CompletionProblem] = []
    for path in files:
        candidates += _file_problems(
            path,
            read_document(path),
            tokenizer,
            opts.max_prompt_tokens,
            opts.min_line_chars,
            opts.max_line_tokens,
            opts.line_cut,
            opts.seed,
        )
    n = opts.n
    if n > len(candidates):
        raise ValueError(f"n={n} exceeds the {len(candidates)} held-out lines available")
    pick = np.sort(np.random.default_rng(opts.seed).choice(len(candidates), size=n, replace=False))
    return [
        TaskItem(p.problem_id, "", p.target, prompt_ids=p.prompt_ids)
        for p in (candidates[i] for i in pick)
    ]


def newline_token_ids(tokenizer) -> set[int]:
    """Every token whose text holds a newline: decoding stops there (one line generated)."""
    return {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}


def score_completion(
    item: TaskItem, output: str, tokens: Sequence[int], opts: GenerateParams
) -> Score:
    """Exact match after whitespace normalization; the prediction is the normalized line."""
    got = normalize_line(output)
    return Score(bool(got) and got == normalize_line(item.target), got)


CODE_COMPLETION = Task(
    "code_completion",
    items=completion_items,
    stops=COMPLETION_STOP,
    score=score_completion,
    stop_tokens=newline_token_ids,
)
