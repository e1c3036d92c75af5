"""The generate stage's options: the config's `generate:` section and the task's own section
(`generate.tasks.<task>`), one flat dataclass; the schema holds every default."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moesub.config import schema_defaults, schema_section
from moesub.params import options_from

# defaults: workflow/schemas/config.schema.yaml (the shared settings, then each task's own)
_DEFAULTS = schema_defaults("generate")
_GSM8K = schema_defaults("generate.tasks.gsm8k")
_HUMANEVAL = schema_defaults("generate.tasks.humaneval")
_COMPLETION = schema_defaults("generate.tasks.code_completion")
_CONTINUATION = schema_defaults("generate.tasks.continuation")
# where the schema checks each option: the shared settings, then every task's own section
_SECTIONS = (
    "generate",
    *(f"generate.tasks.{t}" for t in schema_section("generate.tasks")["properties"]),
)


@dataclass(frozen=True)
class GenerateParams:
    """The generation settings a rule passes (config `generate:` + the task's own section)."""

    n: int = _GSM8K["n"]  # problems (a seeded subsample)
    seed: int = _DEFAULTS["seed"]
    shots: int = _GSM8K["shots"]  # GSM8K few-shot examples
    max_new_tokens: int = _DEFAULTS["max_new_tokens"]
    # keep the last tokens of longer prompts (None: all)
    max_prompt_tokens: int | None = _DEFAULTS["max_prompt_tokens"]
    timeout_s: float = _HUMANEVAL["timeout_s"]  # HumanEval sandbox wall clock per problem
    # code completion: shortest line (normalized characters)
    min_line_chars: int = _COMPLETION["min_line_chars"]
    max_line_tokens: int = _COMPLETION["max_line_tokens"]  # code completion: longest line (tokens)
    # code completion: prompt ends inside the line | at its start
    line_cut: str = _COMPLETION["line_cut"]
    device: str = _DEFAULTS["device"]  # auto | cpu | cuda
    backend: str = _DEFAULTS["backend"]  # engine (timed) | emulator
    # the engine's admission timing: "delay" (the emulator's decisions, so its tokens) or
    # "completion" (copies usable when they land)
    admission: str = _DEFAULTS["admission"]
    # continuation: prompt length (tokens), prompts per forward, the loop's definition
    prompt_tokens: int = _CONTINUATION["prompt_tokens"]
    batch_size: int = _CONTINUATION["batch_size"]
    loop_window: int = _CONTINUATION["loop_window"]  # the tail that must be periodic
    loop_max_period: int = _CONTINUATION["loop_max_period"]  # its longest period (tokens)
    progress: bool = True
    reference_path: str | None = None  # a fetch_every_miss artefact to agree with (else decode)
    # the evaluation text's source (config streams.source; continuation prompts when its path
    # is null; None: the embedded model's corpus)
    source: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> GenerateParams:
        return options_from(cls, params, "generate", section=_SECTIONS)
