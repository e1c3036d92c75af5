"""GSM8K: grade-school math word problems, scored by exact match of the final number.

Data: a local JSONL (`question`, `answer` ending in ``#### <number>``); the repository ships the
test set at data/gsm8k/test.jsonl (MIT, see data/README.md); `fetch_gsm8k` writes one with
`datasets` when online. The last `GSM8K_SHOT_POOL` problems of the file are few-shot examples,
never evaluated.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from moesub.generate.base import Score, Task, TaskItem, subsample
from moesub.generate.params import GenerateParams
from moesub.io import atomic_path

GSM8K_SHOT_POOL = 64  # the last lines of the GSM8K file are few-shot examples, never evaluated
GSM8K_STOP = ("\n\n", "Question:")
GSM8K_HOWTO = (
    "provide the GSM8K test set as JSONL with `question` and `answer` fields (answer ending in "
    "'#### <number>'): e.g. `python -c \"from moesub.generate import fetch_gsm8k; "
    "fetch_gsm8k('{path}')\"` on a machine with internet access, then set "
    "generate.tasks.gsm8k.path in config.yaml"
)


@dataclass(frozen=True)
class GSM8KProblem:
    problem_id: str  # "gsm8k/<line index>"
    question: str
    solution: str  # the reference reasoning (answer field)
    answer: str  # the gold number, normalized


def gsm8k_missing_message(path: str | os.PathLike | None) -> str:
    shown = str(path) if path else "data/gsm8k/test.jsonl"
    return f"GSM8K data file {shown!r} does not exist; " + GSM8K_HOWTO.format(path=shown)


def read_gsm8k(path: str | os.PathLike | None) -> list[GSM8KProblem]:
    """Every problem of a GSM8K JSONL file, in file order."""
    if path is None or not Path(path).is_file():
        raise FileNotFoundError(gsm8k_missing_message(path))
    problems = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {exc}") from exc
            if not isinstance(rec, dict) or not {"question", "answer"} <= set(rec):
                raise ValueError(f"{path}: line {i + 1} lacks the `question`/`answer` fields")
            gold = gsm8k_gold(rec["answer"])
            if gold is None:
                raise ValueError(f"{path}: line {i + 1}: answer has no '#### <number>' line")
            problems.append(GSM8KProblem(f"gsm8k/{i}", rec["question"], rec["answer"], gold))
    if not problems:
        raise ValueError(f"{path}: no GSM8K problems in the file")
    return problems


def _split_gsm8k(problems: list[GSM8KProblem]) -> tuple[list[GSM8KProblem], list[GSM8KProblem]]:
    """(evaluation pool, few-shot pool): the last GSM8K_SHOT_POOL problems are shots only
    (fewer for tiny files: at most a quarter of the file)."""
    pool = min(GSM8K_SHOT_POOL, len(problems) // 4)
    return problems[: len(problems) - pool], problems[len(problems) - pool :]


def load_gsm8k(path: str | os.PathLike | None, n: int, seed: int = 0) -> list[GSM8KProblem]:
    """A seeded subsample of `n` evaluation problems (file order), disjoint from the shots."""
    evaluation, _ = _split_gsm8k(read_gsm8k(path))
    return subsample(evaluation, n, seed, "GSM8K evaluation problems")


def gsm8k_shots(path: str | os.PathLike | None, shots: int) -> list[GSM8KProblem]:
    """The first `shots` problems of the few-shot pool (the same for every seed and n)."""
    _, pool = _split_gsm8k(read_gsm8k(path))
    if shots > len(pool):
        raise ValueError(f"shots={shots} exceeds the {len(pool)} few-shot examples available")
    return pool[:shots]


def _clean_solution(solution: str) -> str:
    """Reference reasoning without calculator annotations, ending 'The answer is X.'"""
    text = re.sub(r"<<[^>]*>>", "", solution).strip()
    body, _, final = text.rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}."


def gsm8k_prompt(question: str, shots: Sequence[GSM8KProblem] = ()) -> str:
    """Few-shot prompt: solved examples, then 'Question: ...\\nAnswer:'."""
    parts = [
        f"Question: {s.question.strip()}\nAnswer: {_clean_solution(s.solution)}\n\n" for s in shots
    ]
    return "".join(parts) + f"Question: {question.strip()}\nAnswer:"


_NUMBER = re.compile(
    r"(?P<sign>(?<![\w).])-)?\$?\s?(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
)


def normalize_number(text: str) -> str | None:
    """Canonical form of a number: no commas, no '$', no trailing zeros ('1,000.50' -> '1000.5')."""
    m = _NUMBER.fullmatch(text.strip())
    if m is None:
        return None
    try:
        value = Decimal(m["int"].replace(",", "") + (m["frac"] or ""))
    except InvalidOperation:
        return None
    if m["sign"]:
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final number in `text` (commas, '$', negatives and decimals handled), normalized."""
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    return normalize_number(matches[-1].group(0))


def gsm8k_gold(answer: str) -> str | None:
    """The gold number after '####' in a GSM8K answer field."""
    _, sep, final = answer.rpartition("####")
    return extract_answer(final) if sep else None


def gsm8k_correct(output: str, gold: str) -> bool:
    pred = extract_answer(output)
    return pred is not None and pred == normalize_number(gold)


def fetch_gsm8k(out_path: str | os.PathLike, split: str = "test") -> Path:
    """Download GSM8K (`openai/gsm8k`, config `main`) with `datasets` and write it as JSONL.

    Needs internet access; the pipeline never calls it (point config at the written file)."""
    from datasets import load_dataset  # here only: no job needs it, and it takes ~2 s to import

    ds = load_dataset("openai/gsm8k", "main", split=split)
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for rec in ds:
            fh.write(json.dumps({"question": rec["question"], "answer": rec["answer"]}) + "\n")
    return Path(out_path)


def gsm8k_items(
    path: str | os.PathLike | None, model_dir: str | os.PathLike, opts: GenerateParams
) -> list[TaskItem]:
    """`opts.n` evaluation problems as `opts.shots`-shot prompts (FileNotFoundError with a
    how-to when data is missing; the model is not needed)."""
    examples = gsm8k_shots(path, opts.shots)
    return [
        TaskItem(p.problem_id, gsm8k_prompt(p.question, examples), p.answer)
        for p in load_gsm8k(path, opts.n, opts.seed)
    ]


def score_gsm8k(item: TaskItem, output: str, tokens: Sequence[int], opts: GenerateParams) -> Score:
    """Correct when the output's final number is the gold one; the prediction is that number."""
    pred = extract_answer(output)
    return Score(pred is not None and pred == item.target, pred or "")


GSM8K = Task("gsm8k", items=gsm8k_items, stops=GSM8K_STOP, score=score_gsm8k)
