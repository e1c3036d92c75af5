"""Free continuation: what the model writes on its own under a policy, measured for
degeneration (repetition, loops) rather than graded.

Prompts: `prompt_tokens` consecutive tokens of a held-out document, each prompt from a different
document. The documents are the model's evaluation text: with the task's `path` null, the eval
split of the configured source (`streams.source`, `moesub.documents`; for the embedded model the
held-out standard-library files and pydoc topics its corpus_files.parquet records, which it
never trained on); with a `path`, every document of that file (.txt / .jsonl / .parquet, as a
text source). Each document is tokenized whole by the model's tokenizer (no special tokens).
Choice (seeded): the documents are visited in a random order (`numpy.random.default_rng(seed)`);
each one of at least `prompt_tokens` tokens is taken, its prompt starting at a token offset
drawn uniformly from the same generator, until `n` are taken; the items keep the documents'
order. The target is the document's own next `max_new_tokens` tokens (shorter at its end),
kept for reading beside the output; nothing is graded.

Decoding: exactly `max_new_tokens` greedy tokens, no stop token, not even end of text (a
fixed-length task: every continuation has the same length, so its measures compare like with
like), all prompts of one length, decoded in batches of `batch_size` on the emulator.

Score: no correct answer (`correct` null, nothing missing); the measures of
`moesub.generate.degeneration` on the generated tokens, with the loop defined by `loop_window`
and `loop_max_period`; the prediction says where the loop is ("loop p=3 x 41 tokens") or is
empty.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moesub.documents import Document, load_documents, read_text_file
from moesub.generate.base import Score, Task, TaskItem
from moesub.generate.degeneration import check_loop_definition, measures
from moesub.generate.params import GenerateParams
from moesub.models import load_tokenizer

EMBEDDED_SOURCE = {"kind": "embedded"}  # the model's own held-out corpus (the default source)


def heldout_documents(
    data_path: str | os.PathLike | None, model_dir: str | os.PathLike, source: dict | None
) -> list[Document]:
    """Every document of `data_path`, else the eval split of `source` (None: the embedded
    model's corpus). FileNotFoundError when either is missing (the stage reports it)."""
    if data_path:
        if not Path(data_path).is_file():
            raise FileNotFoundError(f"continuation: text file {str(data_path)!r} does not exist")
        return read_text_file(data_path)
    return load_documents(Path(model_dir), dict(source or EMBEDDED_SOURCE))["eval"]


def continuation_items(
    data_path: str | os.PathLike | None, model_dir: str | os.PathLike, opts: GenerateParams
) -> list[TaskItem]:
    """`opts.n` prompts of `opts.prompt_tokens` tokens, one per held-out document (module doc)."""
    check_loop_definition(opts.loop_window, opts.loop_max_period)
    if opts.loop_window > opts.max_new_tokens:
        raise ValueError(
            f"loop_window={opts.loop_window} exceeds max_new_tokens={opts.max_new_tokens}: no "
            "continuation could end in a loop"
        )
    docs = heldout_documents(data_path, model_dir, opts.source)
    tokenizer = load_tokenizer(model_dir)
    rng = np.random.default_rng(opts.seed)
    taken: list[tuple[int, list[int], int]] = []  # (document, its tokens, prompt start)
    for i in rng.permutation(len(docs)):
        ids = tokenizer(docs[i].text, add_special_tokens=False)["input_ids"]
        if len(ids) >= opts.prompt_tokens:
            taken.append((int(i), ids, int(rng.integers(0, len(ids) - opts.prompt_tokens + 1))))
            if len(taken) == opts.n:
                break
    if len(taken) < opts.n:
        raise ValueError(
            f"n={opts.n} exceeds the {len(taken)} held-out documents of at least "
            f"prompt_tokens={opts.prompt_tokens} tokens (of {len(docs)})"
        )
    items = []
    for i, ids, start in sorted(taken):
        end = start + opts.prompt_tokens
        target = tokenizer.decode(ids[end : end + opts.max_new_tokens])
        items.append(TaskItem(f"{docs[i].name}@{start}", "", target, prompt_ids=ids[start:end]))
    return items


def score_continuation(
    item: TaskItem, output: str, tokens: Sequence[int], opts: GenerateParams
) -> Score:
    """Not graded; the degeneration measures of the generated tokens (module doc)."""
    m = measures(tokens, opts.loop_window, opts.loop_max_period)
    if not m["ends_in_loop"]:
        return Score(None, "", measures=m)
    return Score(None, f"loop p={m['loop_period']:.0f} x {m['loop_tokens']:.0f} tokens", measures=m)


CONTINUATION = Task(
    "continuation",
    items=continuation_items,
    stops=(),
    score=score_continuation,
    fixed_length=True,
)
