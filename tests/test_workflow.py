"""The Snakemake pipeline, driven through the `snakemake` CLI in a temporary copy of the workflow.

Fast tests: config helpers (`moesub.config`), Experiment B's decision-rule keys, input paths as
rule inputs, `snakemake --lint`, `snakefmt --check`, dry runs listing every stage, bad configs
rejected before any job (naming the key, writing nothing).

Slow tests (`-m slow`): the test config (tests/config/config.yaml) runs the whole DAG to
results/report.html; a second run schedules nothing; changing one policy's tau reruns only that
policy's jobs plus analysis and report; touching the capture script reruns capture and what
depends on it but not the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from moesub import config as mcfg
from moesub.hardware import PROFILES, THIS_MACHINE
from moesub.io import read_metadata

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ("Snakefile", "config.yaml", "workflow", "profiles", "envs", "data",
                  "tests/config")  # fmt: skip
TEST_CONFIG = "tests/config/config.yaml"
# Every rule of the DAG for an embedded model ("all" is the target).
STAGES = {
    "model_embedded", "streams", "capture", "expert_ranking", "simulate", "hardware_profile",
    "price", "emulate", "expb_feasibility", "expb", "expb_factorial_feasibility",
    "expb_factorial", "engine", "engine_bench", "generate", "regime", "analysis", "recommend",
    "plan", "report",
}  # fmt: skip
BIN = Path(sys.executable).parent
# expb keys the workflow or the analysis consume (workflow/rules/common.smk EXPB_ANALYSIS_KEYS)
EXPB_ANALYSIS_KEYS = ("designs", "alpha")


# --------------------------------------------------------------------------------------------
# helpers (also used by tests/test_slurm.py)


def copy_workflow(dest: Path) -> Path:
    """A runnable copy of the workflow (no results) at `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def snakemake(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the snakemake CLI of this interpreter in `cwd`; stdout holds stdout + stderr."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [str(BIN / "snakemake"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def planned_jobs(cwd: Path, *args: str) -> set[tuple[str, str]]:
    """(rule, first output) of every job a dry run schedules."""
    run = snakemake(cwd, "--dry-run", *args)
    assert run.returncode == 0, run.stdout[-4000:]
    jobs: set[tuple[str, str]] = set()
    rule = None
    for line in run.stdout.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line)
        if m:
            if rule is not None:
                jobs.add((rule, ""))
            rule = m.group(1)
            continue
        m = re.match(r"^\s+output: ([^,\s]+)", line)
        if m and rule is not None:
            jobs.add((rule, m.group(1)))
            rule = None
    if rule is not None:
        jobs.add((rule, ""))
    return jobs


def load_test_config() -> dict:
    return yaml.safe_load((REPO / TEST_CONFIG).read_text())


# --------------------------------------------------------------------------------------------
# moesub.config


def test_expand_policies_default_config():
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    pols = mcfg.expand_policies(cfg)
    named = {"fetch_every_miss", "substitute_all", "rule_015", "first_choice", "quality", "speed"}
    assert named | {"host_compute"} <= set(pols)
    assert pols["rule_tau0.08"] == {**pols["rule_015"], "tau": 0.08}
    assert pols["quality_beta0.25"] == {**pols["quality"], "beta": 0.25}
    assert pols["quality_beta1"]["beta"] == 1.0
    assert pols["speed"] == {
        "rule": "first_choice", "tau": 0.0, "eviction": "lfu", "beta": 0.5, "delay": 1
    }  # fmt: skip


def test_expand_policies_errors():
    base = {"policies": {"a": {"rule": "threshold", "tau": 0.1}}}
    with pytest.raises(ValueError, match=r"sweeps.tau.base='nope'"):
        mcfg.expand_policies({**base, "sweeps": {"tau": {"base": "nope", "values": [0.1]}}})
    clash = {"policies": {**base["policies"], "rule_tau0.2": {"rule": "fetch_all"}}}
    with pytest.raises(ValueError, match="rule_tau0.2.*already exists"):
        mcfg.expand_policies({**clash, "sweeps": {"tau": {"base": "a", "values": [0.2]}}})
    with pytest.raises(ValueError, match=r"policies.b.rule: unknown value .nope.; expected one of"):
        mcfg.expand_policies({"policies": {"b": {"rule": "nope"}}})
    with pytest.raises(ValueError, match="reserved"):
        mcfg.expand_policies({"policies": {"all_resident": {"rule": "fetch_all"}}})
    with pytest.raises(ValueError, match="name 'a/b'"):
        mcfg.expand_policies({"policies": {"a/b": {"rule": "fetch_all"}}})
    with pytest.raises(ValueError, match=r"engine.policies: unknown policy name\(s\) \['x'\]"):
        mcfg.policy_subset({"a": {}}, ["a", "x"], "engine.policies")
    assert mcfg.policy_subset({"a": {}}, ["all_resident"], "w", extra=("all_resident",))


def test_capacity_checks():
    cfg = {"models": {"m": {"embedded": True}}, "embedded": {"num_experts": 64,
           "num_experts_per_tok": 4}, "fractions": [0.25, 0.03]}  # fmt: skip
    with pytest.raises(ValueError, match=r"fractions\[1\]=0.03 gives capacity C=2 < k=4"):
        mcfg.check_capacities(cfg)
    cfg["fractions"] = [0.25, 1.0]
    assert mcfg.check_capacities(cfg) == {"m": (64, 4)}
    # Experiment B's substitute pool: k <= C = 5 < 2k - 1 = 7, named by its key
    cfg["expb"] = {"fraction": 0.08}
    with pytest.raises(ValueError, match=r"expb.fraction=0.08 .* 5 experts .* 2k - 1 = 7"):
        mcfg.check_capacities(cfg)
    # every expert may substitute; the factorial design's ranks within k = 4 (default: 6)
    cfg["expb"] = {"fraction": 0.08, "resident": "all"}
    with pytest.raises(ValueError, match=r"factorial.high_ranks=\[6, 6\] reaches past .* k=4"):
        mcfg.check_capacities(cfg)
    cfg["expb"]["designs"] = {"factorial": {"low_ranks": [2, 2], "high_ranks": [3, 4]}}
    assert mcfg.check_capacities(cfg) == {"m": (64, 4)}
    cfg["expb"]["designs"] = {"factorial": {"enabled": False}}
    assert mcfg.check_capacities(cfg) == {"m": (64, 4)}
    # the engine benchmark's own geometry
    cfg["engine"] = {"bench": {"num_experts": 64, "top_k": 20, "fraction": 0.25}}
    with pytest.raises(ValueError, match=r"engine.bench.fraction=0.25 .* C=16 outside \[k=20"):
        mcfg.check_capacities(cfg)
    cfg["engine"]["bench"]["enabled"] = False
    assert mcfg.check_capacities(cfg) == {"m": (64, 4)}


def test_checkpoint_geometry(tmp_path):
    ckpt = tmp_path / "mixtral"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps({"num_local_experts": 8, "num_experts_per_tok": 2})
    )
    cfg = {"models": {"mx": {"path": str(ckpt)}}, "fractions": [0.25]}
    assert mcfg.check_capacities(cfg) == {"mx": (8, 2)}
    cfg["fractions"] = [0.1]
    with pytest.raises(ValueError, match=r"C=1 < k=2 .*config.json of models.mx.path"):
        mcfg.check_capacities(cfg)
    nested = tmp_path / "vl"
    nested.mkdir()
    (nested / "config.json").write_text(
        json.dumps({"text_config": {"num_experts": 512, "num_experts_per_tok": 10}})
    )
    assert mcfg.read_checkpoint_geometry(nested, "w") == (512, 10)
    (nested / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="not a Mixture-of-Experts"):
        mcfg.read_checkpoint_geometry(nested, "w")
    with pytest.raises(FileNotFoundError, match="models.gone.path"):
        mcfg.check_capacities({"models": {"gone": {"path": str(tmp_path / "x")}},
                               "fractions": [0.25]})  # fmt: skip


@pytest.mark.parametrize("path", ["config.yaml", TEST_CONFIG])
def test_load_config(path):
    cfg = mcfg.load_config(REPO / path)
    assert cfg["models"]


# --------------------------------------------------------------------------------------------
# the schema follows the library's parameter dataclasses (keys and defaults:
# tests/test_config_defaults.py)


def _schema_keys(schema: dict, *path: str) -> set[str]:
    node = schema
    for key in path:
        node = node["properties"][key]
    return set(node["properties"])


def test_expb_decision_rule_keys():
    """The expb keys the workflow keeps from the expb jobs are the analysis' decision rule (the
    factorial design's rule is `expb.designs.factorial`'s, minus what its jobs read)."""
    from moesub.expb import FactorialSpec
    from moesub.stats import ExpBRule, FactorialRule

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    rule = {f.name for f in dataclasses.fields(ExpBRule)} - {"factorial"}
    assert rule <= _schema_keys(schema, "expb")
    factorial = _schema_keys(schema, "expb", "designs", "factorial")
    plan = {f.name for f in dataclasses.fields(FactorialSpec)}
    analysis = {f.name for f in dataclasses.fields(FactorialRule)} | {"enabled"}
    assert plan | analysis == factorial and not plan & analysis


# --------------------------------------------------------------------------------------------
# lint, format, dry runs, bad configs


def test_lint(tmp_path):
    wf = copy_workflow(tmp_path / "wf")
    run = snakemake(wf, "--lint")
    assert run.returncode == 0, run.stdout
    assert "Congratulations, your workflow is in a good condition" in run.stdout, run.stdout


def test_snakefmt():
    run = subprocess.run(
        [str(BIN / "snakefmt"), "--check", "Snakefile", "workflow"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("configfile", [None, TEST_CONFIG])
def test_dry_run_lists_every_stage(tmp_path, configfile):
    wf = copy_workflow(tmp_path / "wf")
    args = ["--configfile", configfile] if configfile else []
    jobs = planned_jobs(wf, *args)
    rules = {rule for rule, _ in jobs}
    cfg = mcfg.load_config(wf / (configfile or "config.yaml"))
    # the co-activation table is built only for a policy that substitutes by it
    buddies = any(
        p.get("substitute_by") == "coactivation" for p in mcfg.expand_policies(cfg).values()
    )
    policies = mcfg.expand_policies(cfg)
    planned = [name for name, spec in policies.items() if mcfg.is_planned(spec)]
    extra = ({"coactivation"} if buddies else set()) | ({"allocation"} if planned else set())
    # a model given as a trace exported from a captured one (the test config's embedded_trace)
    models = list(cfg["models"])
    traced = [m for m in models if cfg["models"][m].get("trace")]
    extra |= {"export_trace", "import_trace"} if traced else set()
    assert rules == STAGES | {"all"} | extra
    outputs = {out for _, out in jobs}
    assert "results/report.html" in outputs
    # one job per (policy, size) and stage, at the stage's sizes (simulate: every size); the
    # sweeps expand into named policies; one allocation per planned policy and size
    sizes, stage = mcfg.stage_sizes(cfg), mcfg.stage_policies(cfg, policies)
    assert sizes["simulate"] == mcfg.size_labels(cfg)
    count = {rule: sum(r == rule for r, _ in jobs) for rule in rules}
    assert count["simulate"] == len(policies) * len(sizes["simulate"]) * len(models)
    assert count["emulate"] == len(stage["emulate"]) * len(sizes["emulate"])
    assert count.get("allocation", 0) == len(planned) * len(sizes["simulate"]) * len(models)
    assert {out for rule, out in jobs if rule == "simulate"} == {
        f"results/{model}/simulate/{name}/{size}.parquet"
        for model in models
        for name in policies
        for size in sizes["simulate"]
    }
    # a trace model: no emulate, engine, Experiment B or generation jobs
    for rule, out in jobs:
        if rule in ("emulate", "engine", "expb", "expb_feasibility", "generate"):
            assert out.split("/")[1] not in traced, (rule, out)
    # one profile and one pricing per (model, hardware profile priced): this_machine is fitted
    # to the engine, which a trace model has none of
    priced = [
        (m, h)
        for m in models
        for h in mcfg.priced_hardware(cfg)
        if not (m in traced and h == THIS_MACHINE)
    ]
    assert {out for rule, out in jobs if rule == "price"} == {
        f"results/{m}/priced/{h}.parquet" for m, h in priced
    }
    assert count["hardware_profile"] == len(priced)
    assert not (wf / "results").exists()


def mark_done(wf: Path, configfile: str) -> None:
    """Every output of the DAG as an empty file marked up to date (`--touch`), without running
    a job: what a finished run leaves for the rerun rules to judge."""
    run = snakemake(wf, "--dry-run", "--configfile", configfile)
    assert run.returncode == 0, run.stdout[-4000:]
    for line in run.stdout.splitlines():
        m = re.match(r"^\s+output: (.+)$", line)
        for out in m.group(1).split(", ") if m else ():
            (wf / out).parent.mkdir(parents=True, exist_ok=True)
            if Path(out).suffix:
                (wf / out).touch()
            else:  # a directory() output (figures, the model)
                (wf / out).mkdir(exist_ok=True)
    run = snakemake(wf, "--touch", "--forceall", "--cores", "1", "--configfile", configfile)
    assert run.returncode == 0, run.stdout[-4000:]


def test_a_hardware_profile_reruns_no_replay(tmp_path):
    """A profile added or edited in `hardware:` reruns its profile and pricing jobs and what
    reads the priced runs, never a replay, the engine or its calibration."""
    wf = copy_workflow(tmp_path / "wf")
    mark_done(wf, TEST_CONFIG)
    cfg = load_test_config()
    cfg["hardware"] = {
        "mine": {"description": "my desktop", "source": "estimate", "concurrent_host": True,
                 "link_bandwidth_Bps": "25e9", "transfer_latency_s": 1e-5,
                 "fast_memory_Bps": 6.0e11, "host_memory_Bps": 6.0e10},
    }  # fmt: skip
    (wf / "mine.yaml").write_text(yaml.safe_dump(cfg))
    jobs = planned_jobs(wf, "--configfile", "mine.yaml")
    # both models, the trace model's too (priced on every profile but this_machine); the
    # recommendation changes with the new profile, so every plan (captured models) is rewritten
    per_model = {
        job
        for m in ("embedded", "embedded_trace")
        for job in (
            ("hardware_profile", f"results/{m}/hardware/mine.json"),
            ("price", f"results/{m}/priced/mine.parquet"),
            ("recommend", f"results/{m}/recommendation.json"),
        )
    }
    plans = {
        ("plan", f"results/embedded/plan/{hardware}/{size}.json")
        for hardware in ("this_machine", *PROFILES, "mine")
        for size in ("f0.25", "b3GiB")
    }
    assert jobs == per_model | {
        ("analysis", "results/analysis/models.parquet"),
        ("report", "results/report.html"),
        ("all", ""),
        *plans,
    }, sorted(jobs)


def test_config_paths_are_inputs_of_their_rules(tmp_path):
    """Every local path config names is an input of the rule that reads it: editing it
    re-plans that rule (Snakemake drops a job whose input is missing but whose outputs exist,
    so a path that is only a param would silently keep the old results)."""
    wf = copy_workflow(tmp_path / "wf")
    (wf / "my_eval.jsonl").write_text('{"text": "x"}\n')
    cfg = load_test_config()
    cfg["streams"]["source"] = {"kind": "text", "path": "my_eval.jsonl"}
    (wf / "text.yaml").write_text(yaml.safe_dump(cfg))
    run = snakemake(wf, "--dry-run", "--configfile", "text.yaml")
    assert run.returncode == 0, run.stdout[-3000:]
    inputs: dict[str, set[str]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", run.stdout):
        m = re.match(r"(?:local)?rule (\w+):.*?\n\s+input: ([^\n]*)", block, flags=re.S)
        if m:
            inputs.setdefault(m.group(1), set()).update(m.group(2).split(", "))
    assert "my_eval.jsonl" in inputs["streams"], inputs["streams"]
    assert cfg["generate"]["tasks"]["gsm8k"]["path"] in inputs["generate"], inputs["generate"]
    assert "my_eval.jsonl" in inputs["generate"]  # the continuation's prompts come from it
    assert [key for key, _, _ in mcfg.input_paths(cfg)] == [
        "streams.source.path",
        "generate.tasks.gsm8k.path",
    ]


def test_planned_policy_jobs_and_their_allocation(tmp_path):
    """`sweeps.allocation` adds `<name>_planned`; its allocation job per size reads the
    calibration capture and the expert ranking only (never the evaluation streams), and is an
    input of that policy's jobs only; budgets are sizes of every stage that lists them."""
    wf = copy_workflow(tmp_path / "wf")
    cfg = load_test_config()
    cfg["models"] = {"embedded": {"embedded": True}}  # the trace model's jobs mirror these
    cfg["sweeps"] = {"allocation": ["rule_015"]}
    cfg["emulate"]["sizes"] = [0.25, "3GiB"]
    # the engine runs per-layer slots (the test configuration's planned policy is swept out)
    cfg["engine"]["policies"].remove("fetch_every_miss_planned")
    cfg["engine"]["policies"].append("rule_015_planned")
    (wf / "planned.yaml").write_text(yaml.safe_dump(cfg))
    run = snakemake(wf, "--dry-run", "--configfile", "planned.yaml")
    assert run.returncode == 0, run.stdout[-3000:]
    jobs: dict[str, list[tuple[set[str], str]]] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", run.stdout):
        m = re.match(r"(?:local)?rule (\w+):.*?\n\s+input: ([^\n]*)\n\s+output: ([^\n]*)", block,
                     flags=re.S)  # fmt: skip
        if m:
            jobs.setdefault(m.group(1), []).append((set(m.group(2).split(", ")), m.group(3)))
    alloc = "results/embedded/allocation/rule_015_planned/{}.json"
    assert sorted(out for _, out in jobs["allocation"]) == [
        alloc.format("b3GiB"), alloc.format("f0.25")
    ]  # fmt: skip
    for inputs, _ in jobs["allocation"]:
        assert inputs == {
            "results/embedded/capture/calib_router.parquet",
            "results/embedded/expert_ranking.parquet",
        }
    for rule in ("simulate", "emulate"):
        for inputs, out in jobs[rule]:
            size = out.split(", ")[0].rsplit("/", 1)[1].removesuffix(".parquet")
            planned = "/rule_015_planned/" in out
            assert (alloc.format(size) in inputs) == planned, (rule, out)
    # one engine job per model and device runs every policy: the planned runs' allocations
    # (the engine's sizes only) are its inputs
    ((inputs, out),) = jobs["engine"]
    assert {i for i in inputs if "/allocation/" in i} == {alloc.format("f0.25")}
    assert {out for _, out in jobs["emulate"]} >= {
        "results/embedded/emulate/rule_015_planned/b3GiB.parquet",
        "results/embedded/emulate/quality/b3GiB.parquet",
    }
    assert "results/embedded/engine/cpu/rule_015_planned/f0.25.parquet" in out.split(", ")


def _bad(cfg: dict, edit) -> dict:
    edit(cfg)
    return cfg


BAD_CONFIGS = {
    # schema errors: the key's path, the problem, what is allowed there
    "unknown_top_key": (
        lambda c: c.update(polices={}),
        "config key polices: unknown key (did you mean 'policies'?)\n"
        "  allowed keys at the top level: models, embedded, cpu_kernels, streams,",
    ),
    "unknown_policy_key": (
        lambda c: c["policies"]["quality"].update(tua=0.1),
        "config key policies.quality.tua: unknown key (did you mean 'tau'?)\n"
        "  allowed keys under policies.quality: rule, tau, eviction, beta, delay, prefetch,",
    ),
    "wrong_type": (
        lambda c: c["streams"]["eval"].update(n_streams="two"),
        "config key streams.eval.n_streams: 'two' is not allowed\n  allowed: integer >= 1",
    ),
    "unknown_rule": (
        lambda c: c["policies"]["rule_015"].update(rule="fetch_some"),
        "config key policies.rule_015.rule: 'fetch_some' is not allowed\n"
        "  allowed: one of fetch_all, substitute_all, first_choice, threshold, host_compute",
    ),
    "fraction_zero": (
        lambda c: c.update(fractions=[0.0]),
        "config key fractions[0]: 0.0 is not allowed\n  allowed: number > 0 and <= 1",
    ),
    "fraction_above_one": (
        lambda c: c.update(fractions=[1.5]),
        "config key fractions[0]: 1.5 is not allowed",
    ),
    "bad_dtype": (
        lambda c: c["emulate"].update(dtype="fp8"),
        "config key emulate.dtype: 'fp8' is not allowed\n"
        "  allowed: null | one of float32, bfloat16, float16",
    ),
    "threshold_without_tau": (
        lambda c: c["policies"]["rule_015"].pop("tau"),
        "policies.rule_015.tau: rule 'threshold' needs tau > 0",
    ),
    "capacity_below_k": (lambda c: c.update(fractions=[0.03]), "fractions[0]=0.03 gives"),
    "unknown_policy_in_stage": (
        lambda c: c["generate"].update(policies=["speedy"]),
        "generate.policies: unknown policy name(s) ['speedy']",
    ),
    "missing_checkpoint": (
        lambda c: c["models"].update(real={"path": "/nonexistent/ckpt"}),
        "models.real.path",
    ),
    "bad_stream_source": (
        lambda c: c["streams"]["source"].update(path="x.jsonl"),
        "config key streams.source.path: not allowed with the other keys of streams.source",
    ),
    # every input path is checked before planning (a typo used to reuse the old streams)
    "stream_source_typo": (
        lambda c: c["streams"].update(source={"kind": "text", "path": "data/evl.jsonl"}),
        "streams.source.path: 'data/evl.jsonl' does not exist",
    ),
    "task_data_typo": (
        lambda c: c["generate"]["tasks"]["gsm8k"].update(path="tests/config/gsm8k.jsonl"),
        "generate.tasks.gsm8k.path: 'tests/config/gsm8k.jsonl' does not exist",
    ),
    "checkpoint_names_a_file": (
        lambda c: c["models"].update(real={"path": "tests/config/config.yaml"}),
        "models.real.path: 'tests/config/config.yaml' is a file; give the checkpoint directory",
    ),
    # every capacity rule at parse time: Experiment B's pool needs C >= 2k - 1 (k = 4: 7)
    "expb_pool_below_2k_minus_1": (
        lambda c: c["expb"].update(fraction=0.08),
        "expb.fraction=0.08 gives Experiment B a substitute pool of 5 experts",
    ),
    # the factorial design's ranks are tail ranks of the router's top-k (k = 4)
    "expb_factorial_rank_past_k": (
        lambda c: c["expb"]["designs"]["factorial"].update(high_ranks=[3, 5]),
        "expb.designs.factorial.high_ranks=[3, 5] reaches past the router's top-k",
    ),
    "expb_factorial_bad_band": (
        lambda c: c["expb"]["designs"]["factorial"].update(light=[0.2]),
        "config key expb.designs.factorial.light: [0.2] is not allowed",
    ),
    # cache sizes: budgets priced at the reference geometry (6 MiB bf16 experts, 48 layers)
    "budget_unparsable": (
        lambda c: c.update(budgets=["3GiB", "10 GiB"]),
        "config key budgets[1]: '10 GiB' is not allowed\n  allowed: a string matching",
    ),
    "budget_below_k": (
        lambda c: c.update(budgets=["3GiB", "1GiB"]),
        "budgets[1]='1GiB' gives capacity C=3 < k=4 for model 'embedded'",
    ),
    "budget_above_E": (
        lambda c: c.update(budgets=["100GiB"]),
        "budgets[0]='100GiB' gives capacity C=355 > E=64 for model 'embedded'",
    ),
    "budget_same_size_as_a_fraction": (
        lambda c: c.update(budgets=["4.5GiB"]),  # C = 16, as fractions[0]=0.25
        "budgets[0]='4.5GiB' gives model 'embedded' C=16 slots per layer, as fractions[0]=0.25",
    ),
    "stage_size_not_configured": (
        lambda c: c["emulate"].update(sizes=[0.5]),
        "emulate.sizes[0]=0.5 is not a configured size",
    ),
    "regime_size_below_k": (
        lambda c: c.update(regime={"size": 0.04}),
        "regime.size=0.04 gives capacity C=3 < k=4",
    ),
    # pin specs and allocations: policy keys, resolved per layer
    "pin_spec": (
        lambda c: c["policies"]["quality"].update(pin="half"),
        "config key policies.quality.pin: 'half' is not allowed",
    ),
    "pin_share_above_100": (
        lambda c: c["policies"]["quality"].update(pin="150%"),
        "policies.quality.pin: '150%' is not a pin spec",
    ),
    "pin_too_large_for_a_layer": (
        lambda c: c["policies"]["fetch_every_miss"].update(pin=13),
        "policies.fetch_every_miss.pin at size f0.25 of model 'embedded': pin 13 pins 13 of "
        "C_l=16 slots, leaving fewer than max(k, prefetch) = 4",
    ),
    "allocation_key": (
        lambda c: c["policies"]["quality"].update(allocation="sometimes"),
        "config key policies.quality.allocation: 'sometimes' is not allowed\n"
        "  allowed: one of uniform, planned",
    ),
    "allocation_sweep_base": (
        lambda c: c.update(sweeps={"allocation": ["nope"]}),
        "sweeps.allocation: 'nope' is not a policy",
    ),
    "planned_on_the_bench": (
        lambda c: (
            c["sweeps"]["allocation"].append("rule_015")
            or c["engine"]["bench"]["policies"].append("rule_015_planned")
        ),
        "engine.bench.policies: ['rule_015_planned'] have planned per-layer slot counts",
    ),
}


# Through the CLI (a few; each costs a Snakemake start): schema errors and a parse-time check.
CLI_CASES = ("unknown_top_key", "unknown_policy_key", "wrong_type", "capacity_below_k",
             "stream_source_typo", "expb_pool_below_2k_minus_1", "budget_below_k")  # fmt: skip
# A config error is a few lines (Snakemake's own validation printed the whole schema and config:
# 1,970 lines for a misspelt top-level key, 73 for a misspelt policy field).
MAX_ERROR_LINES = 10


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_config_rejected_before_any_job(tmp_path, case):
    edit, message = BAD_CONFIGS[case]
    wf = copy_workflow(tmp_path / "wf")
    (wf / "bad.yaml").write_text(yaml.safe_dump(_bad(load_test_config(), edit)))
    run = snakemake(wf, "--cores", "1", "--configfile", "bad.yaml", timeout=120)
    assert run.returncode != 0
    assert message in run.stdout, run.stdout[-3000:]
    assert len(run.stdout.splitlines()) < MAX_ERROR_LINES, run.stdout[-3000:]
    for written in ("results", "logs"):
        assert not (wf / written).exists(), f"{written}/ was written for a rejected config"
    metadata = wf / ".snakemake" / "metadata"
    assert not metadata.exists() or not any(metadata.iterdir())


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_rejected_by_load_config(tmp_path, case):
    """The same schema and checks as the Snakefile, in process (`moesub.config.load_config`)."""
    edit, message = BAD_CONFIGS[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_bad(load_test_config(), edit)))
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        mcfg.load_config(path)
    assert message in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) < MAX_ERROR_LINES, str(err.value)


def test_checkpoint_without_tokenizer_rejected_at_parse_time(tmp_path):
    """A checkpoint without tokenizer files is named before any job runs (its first job would
    fail; restoring the files after a good run would then rerun all the model's jobs)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"num_experts": 64, "num_experts_per_tok": 4}))
    wf = copy_workflow(tmp_path / "wf")
    cfg = load_test_config()
    cfg["models"]["real"] = {"path": str(ckpt)}
    cfg["budgets"] = []  # a budget would need the checkpoint's expert shapes too
    (wf / "ckpt.yaml").write_text(yaml.safe_dump(cfg))
    message = (
        f"models.real.path: {str(ckpt)!r} has no tokenizer (none of tokenizer.json, "
        "tokenizer_config.json, tokenizer.model, vocab.json)"
    )
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        mcfg.load_config(wf / "ckpt.yaml")
    run = snakemake(wf, "--dry-run", "--configfile", "ckpt.yaml", timeout=120)
    assert run.returncode != 0 and message in run.stdout, run.stdout[-3000:]
    (ckpt / "tokenizer.json").write_text("{}")  # what moesub.models.load_tokenizer accepts
    assert mcfg.load_config(wf / "ckpt.yaml")["models"]["real"]["path"] == str(ckpt)


# --------------------------------------------------------------------------------------------
# the whole DAG (slow: a few minutes on 2 cores)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    wf = copy_workflow(tmp_path_factory.mktemp("full") / "wf")
    run = snakemake(wf, "--cores", "2", "--configfile", TEST_CONFIG, timeout=3600)
    assert run.returncode == 0, run.stdout[-8000:]
    return wf


@pytest.mark.slow
def test_full_run_produces_report(full_run):
    html = (full_run / "results" / "report.html").read_text()
    assert "<html" in html[:1000].lower() and "</html>" in html[-1000:].lower()
    assert (full_run / "results" / "analysis" / "analysis.json").is_file()
    # heavy rules leave a benchmark (wall time per job) next to the results
    bench = {p.relative_to(full_run / "results" / "benchmarks").parts[1]
             for p in (full_run / "results" / "benchmarks").rglob("*.tsv")
             if len(p.relative_to(full_run / "results" / "benchmarks").parts) > 2}  # fmt: skip
    assert {"simulate", "emulate", "expb", "engine", "generate"} <= bench


@pytest.mark.slow
def test_second_run_schedules_nothing(full_run):
    assert planned_jobs(full_run, "--configfile", TEST_CONFIG) == set()


@pytest.mark.slow
def test_one_policy_change_reruns_only_that_policy(full_run):
    cfg = load_test_config()
    cfg["policies"]["quality"]["tau"] = 0.2
    (full_run / "tau.yaml").write_text(yaml.safe_dump(cfg))
    jobs = planned_jobs(full_run, "--configfile", "tau.yaml") - {("all", "")}
    touched = {(rule, out.split("/")[-2] if rule != "engine_bench" else "") for rule, out in jobs}
    for rule, out in jobs:
        if rule in ("simulate", "emulate", "generate"):
            assert out.split("/")[-2] == "quality", (rule, out)
    expected = {("simulate", "quality"), ("emulate", "quality")}
    # the engine job runs every policy of the model, interleaved with the calibration: it reruns
    # whole (its first output is the calibration), and this_machine's profile with it
    expected |= {("engine", "cpu"), ("hardware_profile", "hardware")}
    expected |= {("generate", "quality")}  # both tasks: same (rule, policy) key
    # the real-size benchmark times the quality policy among others in one job
    expected |= {("engine_bench", ""), ("analysis", "analysis"), ("report", "results")}
    # the recommendations read the analysis; the trace model simulates quality too
    expected |= {("recommend", "embedded"), ("recommend", "embedded_trace")}
    # and every plan (one per priced profile; captured models only) reads the recommendation
    expected |= {("plan", hardware) for hardware in ("this_machine", *PROFILES)}
    expected |= {("price", "priced")}  # every profile prices the new counts (one key)
    assert touched == expected, sorted(jobs)
    assert sum(rule == "generate" for rule, _ in jobs) == len(cfg["generate"]["tasks"])


@pytest.mark.slow
def test_task_policies_and_planned_against_uniform(full_run):
    """A task's own policy list runs only for that task, and a lossless pinned design decodes
    token for token what fetch_every_miss decodes; the planned lossless policy's paired Δppl
    difference from its uniform counterpart is exactly 0, and the engine ran its layout."""
    gen = full_run / "results" / "embedded" / "generate"
    assert (gen / "continuation" / "fitz_tec_pins" / "f0.25.parquet").is_file()
    assert not (gen / "gsm8k" / "fitz_tec_pins").exists()
    pinned, base = (
        pd.read_parquet(gen / "continuation" / name / "f0.25.parquet").sort_values("problem_id")
        for name in ("fitz_tec_pins", "fetch_every_miss")
    )
    assert [list(t) for t in pinned["tokens"]] == [list(t) for t in base["tokens"]]
    alloc = pd.read_parquet(full_run / "results" / "analysis" / "allocation.parquet")
    (row,) = alloc.to_dict("records")
    assert (row["planned"], row["uniform"]) == ("fetch_every_miss_planned", "fetch_every_miss")
    assert row["diff_dppl_pct"] == 0.0 and row["planned_slots"] != row["uniform_slots"]
    html = (full_run / "results" / "report.html").read_text()
    assert 'id="allocation-table"' in html and 'id="plans-table"' in html
    # the engine ran the planned layout: its per-layer slots, as emulate's
    engine = read_metadata(
        full_run / "results/embedded/engine/cpu/fetch_every_miss_planned/f0.25.parquet"
    )
    assert "/".join(map(str, engine["layout"]["capacities"])) == row["planned_slots"]


@pytest.mark.slow
def test_trace_model_simulates_as_the_embedded_model(full_run):
    """The embedded model's capture exported as RTRACE01 (both splits) and imported back as
    embedded_trace: the same streams, the same expert ranking, so every simulate run (every
    policy, the planned allocation too, every size) has the same counts. The logits are
    log(float32 softmax): equal selections, gate weights within float32 rounding, so the
    threshold rules' counts agree too (they could differ only where a gate weight sits
    within rounding of tau)."""
    import pandas as pd

    res = full_run / "results"
    runs = sorted((res / "embedded" / "simulate").rglob("*.parquet"))
    counts = [p for p in runs if p.name.endswith(".counts.parquet")]
    runs = [p for p in runs if p not in counts]
    assert runs and len(counts) == len(runs)
    for path in counts:  # per-token-layer counts (what the price rules price): equal exactly
        twin = res / "embedded_trace" / path.relative_to(res / "embedded")
        assert pd.read_parquet(path).equals(pd.read_parquet(twin)), twin
    counters = ["layer", "tokens", "hit", "fetch", "sub", "host", "hit_rate", "sub_rate"]
    for path in runs:
        twin = res / "embedded_trace" / path.relative_to(res / "embedded")
        a, b = pd.read_parquet(path), pd.read_parquet(twin)
        pd.testing.assert_frame_equal(a[counters], b[counters], check_exact=True, obj=str(twin))
        assert (a["mass_mean"] - b["mass_mean"]).abs().max() < 1e-5, twin
    for name in ("expert_ranking.parquet",):
        pd.testing.assert_frame_equal(
            pd.read_parquet(res / "embedded" / name), pd.read_parquet(res / "embedded_trace" / name)
        )
    # the same counts at the same (reference) bytes: the same prices on every profile both
    # have; this_machine (fitted to the engine) prices the embedded model only
    priced = sorted(p.name for p in (res / "embedded_trace" / "priced").iterdir())
    assert priced and f"{THIS_MACHINE}.parquet" not in priced
    assert (res / "embedded" / "priced" / f"{THIS_MACHINE}.parquet").is_file()
    for name in priced:
        a, b = (pd.read_parquet(res / m / "priced" / name) for m in ("embedded", "embedded_trace"))
        a = a[a["source"] == "simulator"].reset_index(drop=True)
        pd.testing.assert_frame_equal(a, b, obj=name)
    summary = json.loads((res / "embedded_trace" / "trace.json").read_text())
    assert summary["format"] == "rtrace01" and summary["eval_streams"] == 2
    assert "Experiment B" in summary["skipped_stages"]
    assert list(summary["skipped_hardware"]) == [THIS_MACHINE]
    # its recommendation: one simulator ranking per profile it was priced on and size, each
    # candidate's time the embedded model's on the same ranking; no Δppl: the fastest policy
    # with its substituted mass, labelled the quality proxy
    rec, emb = (json.loads((res / m / "recommendation.json").read_text())
                for m in ("embedded_trace", "embedded"))  # fmt: skip
    assert rec["source"] == "trace" and not (res / "embedded_trace" / "plan").exists()
    twins = {(r["hardware"], r["size"]): r for r in emb["rankings"] if r["device"] is None}
    assert {r["hardware"] for r in rec["rankings"]} == {n.removesuffix(".parquet") for n in priced}
    for r in rec["rankings"]:
        assert r["time_source"] == "simulator" and r["within_budget"] is None
        assert r["quality_proxy"]["label"].startswith("quality proxy")
        assert r["fastest"] is not None and r["lossless"]["substituted_mass"] == 0
        times = {c["policy"]: c["time_per_token_s"] for c in r["candidates"]}
        twin = {
            c["policy"]: c["time_per_token_s"]
            for c in twins[(r["hardware"], r["size"])]["candidates"]
        }
        assert times == {p: twin[p] for p in times}
    html = (res / "report.html").read_text()
    assert "embedded_trace (router trace, simulated only)" in html
    assert "a trace model has its routing only" in html


@pytest.mark.slow
def test_export_on_request(full_run):
    """eval.rtrace01 / eval.mblt are not in the default target; asking for them runs the export
    alone, and they read back to the captured trace's selections."""
    from moesub.artefacts import load_trace
    from moesub.traces import ranked_topk, read_trace

    targets = ["results/embedded/capture/eval.mblt", "results/embedded/capture/eval.rtrace01"]
    run = snakemake(full_run, *targets, "--cores", "1", "--configfile", TEST_CONFIG)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "rule export_trace" in run.stdout and "rule capture" not in run.stdout
    captured = load_trace(full_run / "results/embedded/capture/eval_router.parquet")
    ids = ranked_topk(np.concatenate(captured.logits), captured.top_k)
    for target in targets:
        tr = read_trace(full_run / target, top_k=captured.top_k)
        np.testing.assert_array_equal(tr.ids, ids)


@pytest.mark.slow
def test_touching_capture_script_reruns_capture_not_model(full_run):
    script = full_run / "workflow" / "scripts" / "capture.py"
    st = script.stat()
    try:
        os.utime(script)
        rules = {rule for rule, _ in planned_jobs(full_run, "--configfile", TEST_CONFIG)}
    finally:
        os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "capture" in rules
    assert {"expert_ranking", "simulate", "emulate", "engine", "analysis", "report"} <= rules
    # the real-size benchmark replays the captured trace (engine.bench.routing: trace)
    assert "engine_bench" in rules
    # the engine job's calibration times the engine on the calibration capture's tokens, and
    # this_machine's profile is fitted to it
    assert "hardware_profile" in rules and not rules & {"model_embedded", "streams"}
