"""The generation tasks by name, one `Task` record each (defined in the task's own module).

Adding a task: a module that defines its record (problems, prompt, stop, score), one entry
here, and its config section `generate.tasks.<name>` in workflow/schemas/config.schema.yaml
(a test holds the two lists equal).
"""

from __future__ import annotations

from moesub.generate.base import Task
from moesub.generate.completion import CODE_COMPLETION
from moesub.generate.continuation import CONTINUATION
from moesub.generate.gsm8k import GSM8K
from moesub.generate.humaneval import HUMANEVAL

TASKS: dict[str, Task] = {t.name: t for t in (GSM8K, HUMANEVAL, CODE_COMPLETION, CONTINUATION)}


def task_named(name: str) -> Task:
    """The record of the task called `name` (ValueError naming the known tasks otherwise)."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {list(TASKS)}, got {name!r}")
    return TASKS[name]
