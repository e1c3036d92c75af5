"""The generate stage: decode every problem of a task under a policy, score it, compare it with
the exact model's output; one Parquet row per problem (OUTPUT_SCHEMA).

`backend="engine"` (the default) decodes on the offloading engine (`moesub.engine`: experts
really copied, the one policy core, `admission` timing, the engine's options from the `engine:`
config section), so each row carries real time per generated token beside its accuracy; with
`admission="delay"` its tokens are the emulator's (`tests/test_engine_generate.py`).
`backend="emulator"` decodes with `moesub.greedy.greedy_decode` (no timing). The exact model's
output, when no reference artefact is given, always comes from the emulator without a policy.
A fixed-length task (the free continuation: equal-length prompts, no stop) decodes on the
emulator in batches of prompts whatever the backend (`moesub.greedy.greedy_decode_batched`:
each prompt its own caches; its text is the engine's under admission "delay").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from moesub.artefacts import layout_for
from moesub.engine import EngineModel
from moesub.engine.spec import resolve_engine
from moesub.generate.base import Task, TaskItem, agreement, scored_length, truncate_at
from moesub.generate.params import GenerateParams
from moesub.generate.tasks import task_named
from moesub.greedy import greedy_decode, greedy_decode_batched
from moesub.io import write_parquet
from moesub.models import check_checkpoint, load_model, load_tokenizer
from moesub.params import torch_device
from moesub.policy import CORE_BUILD_ID
from moesub.replay import check_run, policy_from_dict
from moesub.sandbox import probe_isolation
from moesub.slots import policy_fields

log = logging.getLogger(__name__)

EXACT_RULES = ("fetch_all", "host_compute")  # never substitute: the exact model's output

OUTPUT_SCHEMA = pa.schema(
    [
        ("task", pa.string()),
        ("problem_id", pa.string()),
        ("policy", pa.string()),
        ("fraction", pa.float64()),
        ("output", pa.string()),  # decoded generation, cut at the task's stop sequence
        ("correct", pa.bool_()),  # null: not scored (missing_reason says why) or not graded
        ("missing_reason", pa.string()),  # "" when scored; e.g. the sandbox's own failure
        ("agree_exact", pa.bool_()),  # same scored tokens as the exact model's greedy output
        ("agree_prefix_frac", pa.float64()),  # common prefix / longer of the two (scored tokens)
        ("mass_per_token_layer", pa.float64()),  # substituted gate mass, mean over scored
        # tokens and MoE layers (null when nothing was scored)
        ("n_tokens", pa.int32()),  # generated tokens (stop token excluded)
        ("n_scored", pa.int32()),  # of which within the stop cut (what scoring saw)
        ("prediction", pa.string()),  # GSM8K: number; HumanEval: status; completion: the line
        ("target", pa.string()),  # GSM8K: gold number; HumanEval: entry point; completion: line
        ("stopped", pa.bool_()),  # ended by a stop token before max_new_tokens
        ("tokens", pa.list_(pa.int32())),  # every generated token id (reference reuse)
        # the task's numeric measures of the scored tokens (continuation: degeneration,
        # moesub.generate.degeneration.DEGENERATION_MEASURES; NaN: undefined); empty: none
        ("measures", pa.map_(pa.string(), pa.float64())),
        # engine backend (null on the emulator): per generated token, the median wall time of
        # the step that produced it, and the mean time blocked on synchronous fetches, late
        # prefetches and the host's experts
        ("time_per_token_s", pa.float64()),
        ("fetch_wait_s", pa.float64()),
        ("prefetch_wait_s", pa.float64()),
        ("host_wait_s", pa.float64()),
    ]
)
TIMING_COLUMNS = ("time_per_token_s", "fetch_wait_s", "prefetch_wait_s", "host_wait_s")


# --------------------------------------------------------------------------- decoding
def _encode(tokenizer, items: list[TaskItem], max_prompt_tokens: int | None) -> list[list[int]]:
    texts = [it.prompt for it in items if it.prompt_ids is None]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    out = []
    for it in items:
        row = list(it.prompt_ids) if it.prompt_ids is not None else next(encoded)
        if not row:
            raise ValueError(f"problem {it.problem_id}: the prompt encodes to no tokens")
        out.append(row[-max_prompt_tokens:] if max_prompt_tokens else row)
    return out


def decode_items(
    model, tokenizer, items: list[TaskItem], policy, capacity, initial, stop, opts,
    fixed_length: bool = False,
) -> list:  # fmt: skip
    """Greedy continuations of every item's prompt: `model` a built `moesub.engine.EngineModel`
    (its own policy; `EngineDecodeResult`s) or a Hugging Face model (the emulator under
    `policy`, None = the exact model; `moesub.greedy.DecodeResult`s). `fixed_length`: exactly
    `max_new_tokens` each, no stop, in batches of `opts.batch_size` prompts (emulator only)."""
    prompts = _encode(tokenizer, items, opts.max_prompt_tokens)
    if fixed_length:
        return greedy_decode_batched(
            model, prompts, policy, capacity, initial, opts.max_new_tokens, opts.batch_size,
            opts.progress,
        )  # fmt: skip
    if isinstance(model, EngineModel):
        return model.generate(prompts, opts.max_new_tokens, stop, opts.progress)
    return greedy_decode(
        model, prompts, policy, capacity, initial, opts.max_new_tokens, stop, opts.progress
    )


def step_times(res) -> dict[str, float | None]:
    """The timing columns of one decoded problem (None on the emulator or with no token)."""
    wall = getattr(res, "wall_s", None)
    if wall is None or len(wall) == 0:
        return dict.fromkeys(TIMING_COLUMNS)
    waits = {c: float(np.mean(res.steps[c])) for c in TIMING_COLUMNS[1:]}
    return {"time_per_token_s": float(np.median(wall)), **waits}


def _reference(path: str | os.PathLike, ids: list[str]) -> list[tuple[list[int], int]]:
    """(tokens, scored tokens) of every problem in a reference artefact."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"params.reference_path: {path} does not exist")
    table = pq.read_table(path, columns=["problem_id", "tokens", "n_scored"]).to_pydict()
    by_id = {
        pid: (list(toks), int(m))
        for pid, toks, m in zip(
            table["problem_id"], table["tokens"], table["n_scored"], strict=True
        )
    }
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"params.reference_path: {path} lacks problem(s) {missing[:5]}")
    return [by_id[i] for i in ids]


def generate_rows(
    model,
    tokenizer,
    task: Task,
    items: list[TaskItem],
    name: str,
    policy,
    fraction: float,
    capacity: int | tuple[int, ...],
    initial,
    num_layers: int,
    opts: GenerateParams,
    exact_model=None,
) -> pa.Table:
    """Decode, score and compare every item; one row per problem (OUTPUT_SCHEMA).

    `task` is the task's record (`moesub.generate.tasks.TASKS`): its stop tokens end decoding,
    its stop sequences cut the output, its `score` scores it. `policy` is a
    `moesub.policy.Policy`; `model` decodes under it (an `EngineModel` built for it, or a
    Hugging Face model for the emulator). `exact_model`, a function returning a Hugging Face
    model (called only when the exact reference is needed; default: `model`), decodes the exact
    reference. Agreement and mass cover the *scored* tokens: those within the task's stop cut,
    on both sides (the exact output is cut the same way)."""
    stop = task.stop_ids(tokenizer)

    def decode_and_cut(policy, capacity, initial, model=model) -> tuple[list, list[str], list]:
        """Decoded results, their stop-cut outputs, and how many tokens each output spans
        (every token when the task has no stop sequence)."""
        results = decode_items(
            model, tokenizer, items, policy, capacity, initial, stop, opts, task.fixed_length
        )
        outputs, n_scored = [], []
        for res in results:
            out = truncate_at(tokenizer.decode(res.tokens, skip_special_tokens=True), task.stops)
            outputs.append(out)
            n_scored.append(
                scored_length(tokenizer, res.tokens, len(out)) if task.stops else len(res.tokens)
            )
        return results, outputs, n_scored

    results, outputs, n_scored = decode_and_cut(policy, capacity, initial)
    if opts.reference_path:
        reference = _reference(opts.reference_path, [it.problem_id for it in items])
    elif policy.rule in EXACT_RULES:  # its greedy output is the exact model's
        reference = [(r.tokens, m) for r, m in zip(results, n_scored, strict=True)]
    else:
        ref_model = model if exact_model is None else exact_model()
        exact, _, exact_scored = decode_and_cut(None, 0, None, model=ref_model)
        reference = [(r.tokens, m) for r, m in zip(exact, exact_scored, strict=True)]
    rows: dict[str, list] = {f.name: [] for f in OUTPUT_SCHEMA}
    for item, res, out, m, (ref, m_ref) in tqdm(
        zip(items, results, outputs, n_scored, reference, strict=True),
        total=len(items),
        desc=f"score {task.name}",
        unit="problem",
        disable=not opts.progress,
    ):
        s = task.score(item, out, res.tokens[:m], opts)
        exact, prefix = agreement(res.tokens[:m], ref[:m_ref])
        rows["task"].append(task.name)
        rows["problem_id"].append(item.problem_id)
        rows["policy"].append(name)
        rows["fraction"].append(float(fraction))
        rows["output"].append(out)
        rows["correct"].append(s.correct)
        rows["missing_reason"].append(s.missing)
        rows["agree_exact"].append(exact)
        rows["agree_prefix_frac"].append(prefix)
        rows["mass_per_token_layer"].append(
            float(np.mean(res.mass[:m])) / num_layers if m else None
        )
        rows["n_tokens"].append(len(res.tokens))
        rows["n_scored"].append(m)
        rows["prediction"].append(s.prediction)
        rows["target"].append(item.target)
        rows["stopped"].append(bool(res.stopped))
        rows["tokens"].append(list(res.tokens))
        rows["measures"].append(s.measures)
        for col, value in step_times(res).items():
            rows[col].append(value)
    return pa.table(rows, schema=OUTPUT_SCHEMA)


# --------------------------------------------------------------------------- stage entry point
def run_generate(
    model_dir: str | os.PathLike,
    task: str,
    data_path: str | os.PathLike | None,
    ranking_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    size: float | Mapping[str, Any],
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
    engine_params: Mapping[str, Any] | None = None,
    allocation_path: str | os.PathLike | None = None,
) -> Path:
    """Generate one (task, policy, size): one row per problem (OUTPUT_SCHEMA) at `out_path`.

    `policy`: the config's policy dict; `size`: a resolved cache size or a fraction; the caches'
    layout comes from the expert ranking at `ranking_path` (and a planned policy's
    `allocation_path`), on the engine backend as on the emulator.

    `data_path`: GSM8K JSONL; HumanEval JSONL(.gz) or None (the bundled copy); code completion:
    a corpus_files.parquet or None (the model's own). When the data is missing, an empty table
    is written whose metadata `missing_data` holds the message (what is missing, how to provide
    it); the message is also logged. `engine_params`: the engine's options (the `engine:`
    section: dtype, store_path, staging_buffers, ...) for `params.backend="engine"`; the
    admission timing comes from `params.admission`.
    """
    record = task_named(task)
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model_dir: {model_dir} does not exist")
    if not Path(ranking_path).is_file():
        raise FileNotFoundError(f"ranking_path: {ranking_path} does not exist")
    check_run(name, size)
    policy_from_dict(policy_fields(policy))
    opts = GenerateParams.from_dict(params)
    if opts.reference_path is not None and not Path(opts.reference_path).is_file():
        raise FileNotFoundError(f"params.reference_path: {opts.reference_path} does not exist")
    info = check_checkpoint(model_dir)
    layout = layout_for(
        ranking_path, size, policy, info.top_k, info.num_layers, info.num_experts,
        allocation_path,
    )  # fmt: skip
    pol = policy_from_dict(layout.policy(policy))
    fraction = layout.size.fraction
    device = torch_device(opts.device)
    spec = None
    backend = "emulator" if record.fixed_length else opts.backend
    if backend == "engine":  # every engine input checked before any work
        eng_params = {**(engine_params or {}), "admission": opts.admission}
        eng_params.setdefault("progress", opts.progress)
        spec = resolve_engine(
            model_dir, name, policy, layout.size, str(device), eng_params,
            ranking_path=ranking_path, allocation_path=allocation_path,
        )  # fmt: skip
    meta: dict[str, Any] = {
        "task": task,
        **layout.run_metadata(name, policy),
        "data_path": None if data_path is None else str(data_path),
        "params": {f.name: getattr(opts, f.name) for f in fields(opts)},
        "core_build_id": CORE_BUILD_ID,
        "backend": backend,
    }
    try:
        items = record.items(data_path, model_dir, opts)
    except FileNotFoundError as exc:
        log.warning("generate %s/%s: %s", task, name, exc)
        meta["missing_data"] = str(exc)
        return write_parquet(OUTPUT_SCHEMA.empty_table(), out_path, metadata=meta)

    capacity, initial = layout.capacities, layout.initial
    if spec is not None:
        tokenizer = load_tokenizer(model_dir)
        with EngineModel(model_dir, spec) as engine:
            table = generate_rows(
                engine, tokenizer, record, items, name, pol, fraction, capacity, initial,
                info.num_layers, opts,
                exact_model=lambda: load_model(model_dir, device=device)[0],
            )  # fmt: skip
            meta["tier"] = engine.setup.tier.description
            meta["admission"] = opts.admission
    else:
        model, tokenizer = load_model(model_dir, device=device)
        if tokenizer is None:
            raise ValueError(f"model_dir: {model_dir} has no tokenizer; generation needs one")
        table = generate_rows(
            model, tokenizer, record, items, name, pol, fraction, capacity, initial,
            info.num_layers, opts,
        )  # fmt: skip
    if record.sandboxed:
        meta["sandbox"] = probe_isolation()
    meta["num_moe_layers"] = info.num_layers
    meta["n"] = table.num_rows
    correct = [c for c in table.column("correct").to_pylist() if c is not None]
    meta["n_missing"] = table.num_rows - len(correct)
    acc = float(np.mean(correct)) if correct else math.nan
    log.info("generate %s/%s f%s: accuracy %.3f over %d", task, name, fraction, acc, len(correct))
    meta["accuracy"] = acc if not math.isnan(acc) else None
    times = [t for t in table.column("time_per_token_s").to_pylist() if t is not None]
    meta["time_per_token_median_s"] = float(np.median(times)) if times else None
    return write_parquet(table, out_path, metadata=meta)
