"""The config schema owns every default (workflow/schemas/config.schema.yaml).

Each config section maps onto the library's options dataclass for it. Every key of the section
is an option of that dataclass (a renamed option fails here), and every option the schema knows
has the schema's default as its own default in code: a default changed in one place only fails
here. Keys without a schema default are listed below with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
from typing import Any

import pytest
import yaml

from moesub import config as mcfg

SHIPPED_CONFIGS = ("config.yaml", "tests/config/config.yaml")

# (schema section, "module:Class", keys of the section that are not options of the class)
SECTIONS = [
    # the layout keys (moesub.slots.LAYOUT_KEYS): resolved per layer into the Policy
    ("policies.*", "moesub.policy:Policy", {"pin", "allocation"}),
    ("models.*.loading", "moesub.models:ModelLoading", set()),
    ("embedded", "moesub.embedded:EmbeddedConfig", set()),
    ("streams", "moesub.streams:StreamsConfig", {"source"}),
    ("capture", "moesub.capture:CaptureParams", set()),
    ("emulate", "moesub.emulate:EmulateParams", {"policies", "sizes"}),
    ("expb", "moesub.expb:ExpBParams", {"alpha", "designs"}),
    (
        "expb",
        "moesub.stats:ExpBRule",
        {"fraction", "resident", "seed", "max_streams", "dtype", "device", "designs"},
    ),  # fmt: skip
    ("engine", "moesub.engine:EngineParams", {"devices", "policies", "sizes", "bench"}),
    ("engine.bench", "moesub.engine:BenchParams", {"enabled", "policies", "trace_model"}),
    ("generate", "moesub.generate:GenerateParams", {"tasks", "policies", "sizes"}),
    ("generate.tasks.gsm8k", "moesub.generate:GenerateParams", {"path", "policies"}),
    ("generate.tasks.humaneval", "moesub.generate:GenerateParams", {"path", "policies"}),
    ("generate.tasks.code_completion", "moesub.generate:GenerateParams", {"path", "policies"}),
    ("analysis", "moesub.stats:AnalysisParams", set()),
    ("recommend", "moesub.recommend:RecommendParams", set()),
    ("models.*.loading", "moesub.models:ModelLoading", set()),
    ("hardware.*", "moesub.hardware:HardwareProfile", set()),
]

# Keys the schema gives no default, on purpose (checked to have none).
NO_DEFAULT = {
    "policies.*.rule": "required: a policy names its rule",
    "engine.store_path": "the workflow puts the expert file under results/<model>/engine/",
    **{
        f"generate.tasks.{task}.{key}": f"inherits generate.{key} (a default would override it)"
        for task, keys in {
            "gsm8k": ("seed", "max_prompt_tokens"),
            "humaneval": ("seed", "max_prompt_tokens"),
            "code_completion": ("seed", "max_prompt_tokens", "max_new_tokens"),
        }.items()
        for key in keys
    },
    **{
        f"hardware.*.{key}": "a profile's required key"
        for key in (
            "description",
            "source",
            "concurrent_host",
            "link_bandwidth_Bps",
            "transfer_latency_s",
            "fast_memory_Bps",
            "host_memory_Bps",
        )
    },  # fmt: skip
    **{
        f"hardware.*.{key}": "left out: none (HardwareProfile's None)"
        for key in ("host_cores", "host_core_Bps", "dense_layer_s", "install_Bps", "host_read_Bps")
    },
}


def _class(target: str) -> type:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _code_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _plain(value: Any) -> Any:
    """Compare as the YAML would hold it: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _schema_keys(section: str) -> dict[str, Any]:
    return mcfg.schema_section(section)["properties"]


@pytest.mark.parametrize(("section", "target", "workflow_keys"), SECTIONS)
def test_section_keys_are_options(section, target, workflow_keys):
    fields = {f.name for f in dataclasses.fields(_class(target))}
    keys = set(_schema_keys(section)) - workflow_keys
    assert keys <= fields, f"config {section} keys unknown to {target}: {keys - fields}"


@pytest.mark.parametrize(("section", "target", "workflow_keys"), SECTIONS)
def test_code_defaults_are_the_schema_defaults(section, target, workflow_keys):
    schema = mcfg.schema_defaults(section)
    mismatches = []
    for field in dataclasses.fields(_class(target)):
        key = f"{section}.{field.name}"
        if field.name not in _schema_keys(section) or field.name in workflow_keys:
            continue  # a library-only option (progress, threads, ...)
        if key in NO_DEFAULT:
            assert field.name not in schema, f"{key} has a schema default: {NO_DEFAULT[key]}"
            continue
        assert field.name in schema, f"{key}: no default in the schema (code: {field.default!r})"
        expected = schema[field.name]
        if isinstance(expected, dict):  # an object: its keys' defaults fill it
            expected = {**mcfg.schema_defaults(key), **expected}
        code = _plain(_code_default(field))
        if code != expected:
            mismatches.append(f"{key}: code {code!r} != schema {expected!r}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("design", ["study", "matched"])
def test_design_rule_defaults_are_the_schema_defaults(design):
    """The analysis' decision rule of each Experiment B design defaults as the schema does."""
    from moesub.stats import ExpBRule

    schema = mcfg.schema_defaults(f"expb.designs.{design}")
    rule = ExpBRule.from_mapping({"designs": {design: {"primary": 0.01}}}).designs[design]
    options = {f.name for f in dataclasses.fields(rule)} - {"design", "primary", "heavy_mass"}
    assert options, rule
    for key in options:
        if getattr(rule, key) is not None:
            assert getattr(rule, key) == schema[key], f"expb.designs.{design}.{key}"


def test_workflow_helpers_read_the_schema():
    """moesub.config's own defaults are the schema's: the policy fields, the embedded geometry."""
    v1 = {key: mcfg.POLICY_DEFAULTS[key] for key in ("tau", "eviction", "beta", "delay")}
    assert v1 == {"tau": 0.0, "eviction": "lru", "beta": 0.0, "delay": 1}
    assert mcfg.schema_defaults("policies.*") == mcfg.POLICY_DEFAULTS
    cfg = {"models": {"m": {"embedded": True}}, "embedded": {}}
    emb = mcfg.schema_defaults("embedded")
    assert mcfg.model_geometry(cfg, "m") == (emb["num_experts"], emb["num_experts_per_tok"])


def test_load_config_fills_schema_defaults(tmp_path):
    """`load_config` fills the defaults as the workflow's validation does."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "models: {m: {embedded: true}}\nstreams: {source: {kind: embedded}}\n"
        "fractions: [0.25]\npolicies: {fetch_every_miss: {rule: fetch_all}}\n"
    )
    cfg = mcfg.load_config(path)
    assert cfg["streams"]["eval"] == mcfg.schema_defaults("streams.eval")
    assert cfg["engine"]["bench"]["fraction"] == mcfg.schema_defaults("engine.bench")["fraction"]
    assert cfg["embedded"]["num_experts"] == 512
    assert "store_path" not in cfg["engine"]


def _configs() -> list[dict[str, Any]]:
    """The shipped configs, plus one with what they leave out (a checkpoint model placed by
    Accelerate, a text source, every sweep, optional dtypes)."""
    repo = mcfg.SCHEMA_PATH.parents[2]
    shipped = [yaml.safe_load((repo / p).read_text()) for p in SHIPPED_CONFIGS]
    more = copy.deepcopy(shipped[1])
    more["models"]["real"] = {"path": "/ckpt", "loading": {"device_map": "auto"}}
    more["streams"]["source"] = {"kind": "text", "path": "eval.jsonl"}
    more["sweeps"] = {"route_bias": {"base": "quality", "values": [0.1]}, "belady": ["quality"]}
    more["emulate"] = {"dtype": "bfloat16"}
    more["engine"] = {"bench": {}}
    more["hardware"] = {
        "price": ["this_machine", "mine"],
        "mine": {"description": "d", "source": "estimate", "concurrent_host": True,
                 "link_bandwidth_Bps": 25.0e9, "transfer_latency_s": 1e-5,
                 "fast_memory_Bps": 600.0e9, "host_memory_Bps": 60.0e9},
    }  # fmt: skip
    return [*shipped, more]


@pytest.mark.parametrize("config", _configs(), ids=[*SHIPPED_CONFIGS, "more"])
def test_validate_config_fills_defaults_as_snakemake_did(config):
    """`validate_config` (the Snakefile's check) leaves the config exactly as Snakemake's
    `validate` did before it, so every job's params are the same (no rerun)."""
    from snakemake.utils import validate

    ours, theirs = copy.deepcopy(config), copy.deepcopy(config)
    validate(theirs, str(mcfg.SCHEMA_PATH))
    assert mcfg.validate_config(ours) is ours
    assert ours == theirs
    assert json.dumps(ours) == json.dumps(theirs)  # key order and value types too
