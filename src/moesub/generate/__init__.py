"""Greedy generation under a cache/substitution policy (the generate stage, docs/architecture.md).

Every problem is decoded greedily twice from the same prompt: under the policy (the emulator's
decode mode, `moesub.greedy.greedy_decode`, with per-layer caches fresh from the initial
resident set) and with the exact model (every expert resident; `fetch_every_miss` computes the
same thing, so the workflow reuses that policy's artefact as the reference). The policy's output
is cut at the task's stop sequence and scored; agreement with the exact output compares the
tokens within the same cut on both sides (exact agreement, and the fraction of tokens before
the first divergence). Substituted mass is per token-layer: the mean over the scored tokens of
the gate mass substituted in the forward step that produced each token, divided by the number
of MoE layers.

Tasks, one module each, each defining its `Task` record (how its problems are loaded and
prompted, where decoding stops, how an output is scored, whether scoring runs in the sandbox);
`moesub.generate.tasks.TASKS` lists them by name, and the stage knows a task only through it:

- `gsm8k`: grade-school math, exact match of the final number (the test set ships in data/);
- `humaneval`: pass@1 by running the problem's tests in `moesub.sandbox` (a sentinel proves
  that `check()` returned; a sandbox failure of its own leaves the problem unscored);
- `completion` (task `code_completion`): the next line of held-out standard-library code,
  exact match after whitespace normalization: a task the small embedded model can do;
- `continuation`: free greedy continuation of held-out text, not graded but measured for
  degeneration (`degeneration`: repeated 4-grams, the longest repeated span, ending in a loop);
  fixed length (no stop), so its equal-length prompts decode in batches on the emulator.

Missing data is not fatal for the pipeline: `run_generate` writes an empty artefact whose
metadata says what is missing and how to provide it, so the report can show the message.
"""

from moesub.generate.base import (
    Score,
    Task,
    TaskItem,
    agreement,
    scored_length,
    subsample,
    truncate_at,
)
from moesub.generate.completion import (
    code_line_starts,
    completion_items,
    heldout_code_files,
    normalize_line,
)
from moesub.generate.continuation import continuation_items
from moesub.generate.degeneration import (
    DEGENERATION_MEASURES,
    longest_repeat,
    repeated_ngram_share,
    tail_loop,
)
from moesub.generate.gsm8k import (
    GSM8K_SHOT_POOL,
    GSM8K_STOP,
    extract_answer,
    fetch_gsm8k,
    gsm8k_correct,
    gsm8k_gold,
    gsm8k_missing_message,
    gsm8k_prompt,
    gsm8k_shots,
    load_gsm8k,
    normalize_number,
    read_gsm8k,
)
from moesub.generate.humaneval import (
    HUMANEVAL_STOP,
    build_humaneval_program,
    check_humaneval,
    load_humaneval,
    read_humaneval,
)
from moesub.generate.params import GenerateParams
from moesub.generate.run import OUTPUT_SCHEMA, generate_rows, run_generate
from moesub.generate.tasks import TASKS, task_named

__all__ = [
    "DEGENERATION_MEASURES",
    "GSM8K_SHOT_POOL",
    "GSM8K_STOP",
    "HUMANEVAL_STOP",
    "OUTPUT_SCHEMA",
    "TASKS",
    "GenerateParams",
    "Score",
    "Task",
    "TaskItem",
    "agreement",
    "build_humaneval_program",
    "check_humaneval",
    "code_line_starts",
    "completion_items",
    "continuation_items",
    "extract_answer",
    "fetch_gsm8k",
    "generate_rows",
    "gsm8k_correct",
    "gsm8k_gold",
    "gsm8k_missing_message",
    "gsm8k_prompt",
    "gsm8k_shots",
    "heldout_code_files",
    "load_gsm8k",
    "load_humaneval",
    "longest_repeat",
    "normalize_line",
    "normalize_number",
    "read_gsm8k",
    "read_humaneval",
    "repeated_ngram_share",
    "run_generate",
    "scored_length",
    "subsample",
    "tail_loop",
    "task_named",
    "truncate_at",
]
