"""Pipeline configuration helpers: policy expansion, model geometry and capacity checks.

The Snakemake workflow (workflow/rules/common.smk) imports these at parse time, after the JSON
schema has validated `config.yaml`, so that every error is raised before any job runs and names
the offending key. They are plain functions of the config dict, usable outside Snakemake too
(`load_config` = read YAML + schema + the checks below).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moesub.policy import EVICTIONS, RULES

POLICY_KEYS = ("rule", "tau", "eviction", "beta", "delay")


POLICY_DEFAULTS: dict[str, Any] = {"tau": 0.0, "eviction": "lru", "beta": 0.0, "delay": 1}
# The engine's reserved policy name: every expert in fast memory (the floor on time per token).
# It may be listed in engine.policies / engine.bench.policies but not defined under policies:.
ALL_RESIDENT = "all_resident"
ALL_RESIDENT_POLICY: dict[str, Any] = {"rule": "fetch_all", **POLICY_DEFAULTS}
# moesub.embedded.EmbeddedConfig defaults (repeated here so parse-time checks need no torch).
EMBEDDED_DEFAULT_E = 512
EMBEDDED_DEFAULT_K = 10
# The cache fraction at which the study gives its regime figures (moesub.regime): 25% resident.
REGIME_FRACTION = 0.25
# Names become path components and Snakemake wildcard values.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# HF config.json keys holding the number of routed experts / experts per token, by family.
_E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")


def number_label(value: float) -> str:
    """Canonical text of a number in names and paths: 0.25 -> "0.25", 1.0 -> "1", 0.1 -> "0.1"."""
    return format(float(value), "g")


def capacity(fraction: float, num_experts: int) -> int:
    """Resident experts per layer for a cache fraction: C = floor(fraction * E + 0.5)."""
    return math.floor(fraction * num_experts + 0.5)


def canonical(value: Any) -> Any:
    """`value` with every mapping's keys sorted (recursively).

    Snakemake compares a job's params with the recorded ones in order; canonical params make
    reordering keys in config.yaml a no-op instead of a rerun of everything.
    """
    if isinstance(value, Mapping):
        return {str(k): canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return value


def normalize_policy(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A full `{rule, tau, eviction, beta, delay}` dict (defaults filled), checked."""
    where = f"policies.{name}"
    unknown = sorted(set(spec) - set(POLICY_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {list(POLICY_KEYS)}")
    if "rule" not in spec:
        raise ValueError(f"{where}.rule is required (one of {list(RULES)})")
    policy = {**POLICY_DEFAULTS, **spec}
    if policy["rule"] not in RULES:
        raise ValueError(f"{where}.rule={policy['rule']!r} is not one of {list(RULES)}")
    if policy["eviction"] not in EVICTIONS:
        raise ValueError(f"{where}.eviction={policy['eviction']!r} is not one of {list(EVICTIONS)}")
    for key in ("tau", "beta"):
        value = policy[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}.{key}={value!r} must be a number >= 0")
        policy[key] = float(value)
    delay = policy["delay"]
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
        raise ValueError(f"{where}.delay={delay!r} must be an integer >= 1")
    if policy["rule"] == "threshold" and policy["tau"] <= 0:
        raise ValueError(f"{where}.tau must be > 0 for rule 'threshold'")
    return {key: policy[key] for key in POLICY_KEYS}


def is_exact_twin(policy: Mapping[str, Any], candidate: Mapping[str, Any]) -> bool:
    """`candidate` is the no-admission twin of admission policy `policy`: same rule, eviction
    and (for `threshold`) tau, beta 0. Only such a pair isolates the effect of admission."""
    return (
        candidate["beta"] == 0
        and candidate["rule"] == policy["rule"]
        and candidate["eviction"] == policy["eviction"]
        and (policy["rule"] != "threshold" or math.isclose(candidate["tau"], policy["tau"]))
    )


def twin_spec(policy: Mapping[str, Any]) -> str:
    """The config line of an admission policy's exact twin (for messages)."""
    tau = f", tau: {number_label(policy['tau'])}" if policy["rule"] == "threshold" else ""
    return f"{{rule: {policy['rule']}{tau}, eviction: {policy['eviction']}}}"


def missing_admission_twins(
    policies: Mapping[str, Mapping[str, Any]], names: list[str] | None = None
) -> list[str]:
    """One message per admission policy (beta > 0) among `names` (None: all) without its
    exact twin among `names`: its admission effect cannot be measured."""
    names = list(policies) if names is None else names
    out = []
    for name in names:
        pol = policies[name]
        if pol["beta"] > 0 and not any(is_exact_twin(pol, policies[n]) for n in names if n != name):
            out.append(f"{name} has no exact no-admission twin (add a policy {twin_spec(pol)})")
    return out


def check_name(name: str, where: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{where}: name {name!r} must match {_NAME_RE.pattern} (it becomes a path component)"
        )


def expand_policies(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Named policies plus sweep policies, name -> full policy dict, in a stable order.

    `sweeps.tau = {base, values}` adds `rule_tau<v>` = the `base` policy with `tau=v`;
    `sweeps.beta = {base, values}` adds `<base>_beta<v>` = the `base` policy with `beta=v`.
    A sweep name that collides with a named policy is an error (say it once).
    """
    named = config.get("policies") or {}
    if not named:
        raise ValueError("policies: at least one policy is required")
    out: dict[str, dict[str, Any]] = {}
    for name, spec in named.items():
        check_name(name, f"policies.{name}")
        if name == ALL_RESIDENT:
            raise ValueError(f"policies.{name}: the name is reserved for the engine's floor run")
        out[name] = normalize_policy(name, spec)
    sweeps = config.get("sweeps") or {}
    for key in ("tau", "beta"):
        sweep = sweeps.get(key)
        if not sweep:
            continue
        base = sweep.get("base")
        if base not in out:
            raise ValueError(f"sweeps.{key}.base={base!r} is not a policy in policies:")
        for value in sweep.get("values", []):
            name = (
                f"rule_tau{number_label(value)}"
                if key == "tau"
                else f"{base}_beta{number_label(value)}"
            )
            if name in out:
                raise ValueError(f"sweeps.{key}: policy {name!r} already exists")
            spec = {**out[base], key: value}
            if key == "tau":
                spec["rule"] = "threshold"
            out[name] = normalize_policy(name, spec)
    return out


def policy_subset(
    policies: Mapping[str, Mapping[str, Any]],
    names: list[str] | None,
    where: str,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """Names selected by a stage's `policies:` list (None = all), each checked to exist.

    `extra`: reserved names the stage accepts besides the configured policies (`all_resident`).
    """
    if names is None:
        return list(policies)
    missing = [n for n in names if n not in policies and n not in extra]
    if missing:
        known = list(policies) + list(extra)
        raise ValueError(f"{where}: unknown policy name(s) {missing}; known: {known}")
    return list(names)


def stage_policies(
    config: Mapping[str, Any], policies: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[str] | None]:
    """The policy names each stage runs, checked against the expanded policies.

    `engine` and `engine_bench` may also list `all_resident`; `engine_bench` is None when its
    list is null (the library's own study set). `analysis.baseline` must be a policy. Warns
    (UserWarning) for every emulated admission policy without its exact twin.
    """

    def names(*keys: str) -> list[str] | None:
        node: Any = config
        for key in keys:
            node = (node or {}).get(key)
        return node

    out: dict[str, list[str] | None] = {
        stage: policy_subset(policies, names(stage, "policies"), f"{stage}.policies")
        for stage in ("simulate", "emulate", "generate")
    }
    out["engine"] = policy_subset(
        policies, names("engine", "policies"), "engine.policies", extra=(ALL_RESIDENT,)
    )
    bench = names("engine", "bench", "policies")
    out["engine_bench"] = (
        None
        if bench is None
        else policy_subset(policies, bench, "engine.bench.policies", extra=(ALL_RESIDENT,))
    )
    baseline = names("analysis", "baseline")
    if baseline is not None:
        policy_subset(policies, [baseline], "analysis.baseline")
    # a warning, not an error: a run may leave a twin out on purpose (the analysis then reports
    # that admission effect as missing, with this reason)
    for message in missing_admission_twins(policies, out["emulate"]):
        warnings.warn(f"emulate.policies: {message}", UserWarning, stacklevel=2)
    return out


def read_checkpoint_geometry(path: str | Path, where: str) -> tuple[int, int]:
    """(E, k) from a Hugging Face checkpoint's config.json (text_config for multimodal ones)."""
    cfg_path = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{where}: checkpoint directory {str(path)!r} does not exist")
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{where}: {str(cfg_path)!r} not found (not a HF checkpoint)")
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg) if not any(k in cfg for k in _E_KEYS) else cfg
    num_experts = next((cfg[k] for k in _E_KEYS if cfg.get(k)), None)
    top_k = next((cfg[k] for k in _K_KEYS if cfg.get(k)), None)
    if num_experts is None or top_k is None:
        raise ValueError(
            f"{where}: {str(cfg_path)!r} has no expert count ({'/'.join(_E_KEYS)}) or top-k "
            f"({'/'.join(_K_KEYS)}): not a Mixture-of-Experts model"
        )
    return int(num_experts), int(top_k)


def model_geometry(config: Mapping[str, Any], name: str) -> tuple[int, int]:
    """(E, k) of model `name`: from the `embedded:` section or from the checkpoint's config.json."""
    spec = config["models"][name]
    if spec.get("embedded"):
        emb = config.get("embedded") or {}
        return (
            int(emb.get("num_experts", EMBEDDED_DEFAULT_E)),
            int(emb.get("num_experts_per_tok", EMBEDDED_DEFAULT_K)),
        )
    return read_checkpoint_geometry(spec["path"], f"models.{name}.path")


def check_capacities(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every (model, fraction) must give k <= C <= E; returns model -> (E, k)."""
    geometry = {}
    fractions = [("fractions", i, f) for i, f in enumerate(config["fractions"])]
    expb_fraction = (config.get("expb") or {}).get("fraction")
    if expb_fraction is not None:
        fractions.append(("expb.fraction", None, expb_fraction))
    for name in config["models"]:
        check_name(name, f"models.{name}")
        num_experts, top_k = model_geometry(config, name)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model {name!r}: top-k {top_k} must be in [1, E={num_experts}]")
        source = (
            "embedded.num_experts / embedded.num_experts_per_tok"
            if config["models"][name].get("embedded")
            else f"config.json of models.{name}.path"
        )
        for key, index, fraction in fractions:
            label = key if index is None else f"{key}[{index}]"
            cap = capacity(fraction, num_experts)
            if cap < top_k:
                raise ValueError(
                    f"{label}={fraction} gives capacity C={cap} < k={top_k} for model {name!r} "
                    f"(E={num_experts}, k from {source}): "
                    "C = floor(fraction * E + 0.5) must be >= k"
                )
            if cap > num_experts:
                raise ValueError(f"{label}={fraction} gives C={cap} > E={num_experts}")
        geometry[name] = (num_experts, top_k)
    return geometry


def load_config(path: str | Path, schema_path: str | Path | None = None) -> dict[str, Any]:
    """Read a pipeline config YAML, validate it against the schema (defaults filled), check it.

    The same checks the workflow runs at parse time; raises `ValueError` naming the key.
    """
    import jsonschema
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found")
    config = yaml.safe_load(path.read_text()) or {}
    if schema_path is None:
        schema_path = Path(__file__).resolve().parents[2] / "workflow/schemas/config.schema.yaml"
    schema = yaml.safe_load(Path(schema_path).read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        key = ".".join(str(p) for p in err.absolute_path) or "<top level>"
        raise ValueError(f"config {str(path)!r}: {key}: {err.message}")
    stage_policies(config, expand_policies(config))
    check_capacities(config)
    return config
