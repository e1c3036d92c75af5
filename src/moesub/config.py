"""Pipeline configuration helpers: schema defaults, policy expansion, model geometry, capacity
and input-path checks.

The Snakemake workflow (workflow/rules/common.smk) imports these at parse time, after the JSON
schema has validated `config.yaml`, so that every error is raised before any job runs and names
the offending key. They are plain functions of the config dict, usable outside Snakemake too
(`load_config` = read YAML + schema + the checks below).

The schema (workflow/schemas/config.schema.yaml) owns every default: `schema_defaults(section)`
reads them, and tests/test_config_defaults.py holds every options dataclass's defaults equal to
the schema's.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moesub.policy import EVICTIONS, OFFLINE_EVICTIONS, RULES, Policy, capacity_for

# The repository's schema (an editable install); a wheel carries a copy beside this module.
_REPO_SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_PATH = (
    _REPO_SCHEMA if _REPO_SCHEMA.is_file() else Path(__file__).with_name(_REPO_SCHEMA.name)
)


@functools.cache
def config_schema() -> dict[str, Any]:
    """The pipeline's JSON schema (read once)."""
    import yaml

    if not SCHEMA_PATH.is_file():
        raise FileNotFoundError(
            f"config schema {str(_REPO_SCHEMA)!r} not found (nor a copy beside moesub/config.py)"
        )
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _resolve(node: Mapping[str, Any]) -> dict[str, Any]:
    """A schema node with its `$ref` (to `#/$defs/...`) merged in; the node's own keys win."""
    node = dict(node)
    while "$ref" in node:
        ref = node.pop("$ref")
        target = config_schema()["$defs"][ref.removeprefix("#/$defs/")]
        node = {**target, **node}
    return node


def _section(section: str) -> dict[str, Any]:
    """The schema node of a config section (dotted keys, `*` = any name; see schema_defaults)."""
    node = _resolve(config_schema())
    for key in section.split("."):
        node = _resolve(node["additionalProperties"] if key == "*" else node["properties"][key])
    return node


def check_options(values: Mapping[str, Any], sections: str | tuple[str, ...], what: str) -> None:
    """Every value whose key the config sections' schema knows, checked against it (type, range,
    enum: the schema is their one home; dataclasses keep the cross-field checks). The first
    section that knows a key gives its schema. Raises ValueError naming `params.<key>`."""
    import jsonschema

    props: dict[str, Any] = {}
    for section in (sections,) if isinstance(sections, str) else sections:
        for key, prop in _section(section).get("properties", {}).items():
            props.setdefault(key, prop)
    known = {key: props[key] for key in values if key in props}
    schema = {"$defs": config_schema()["$defs"], "type": "object", "properties": known}
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(dict(values)), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        key = str(err.absolute_path[0]) if err.absolute_path else "?"
        raise ValueError(f"params.{key}={values.get(key)!r} ({what}): {err.message}")


def schema_defaults(section: str) -> dict[str, Any]:
    """The schema's default of every key of a config section that has one (deep copies).

    `section`: dotted keys through the schema's `properties` ("emulate", "engine.bench",
    "generate.tasks.gsm8k"); `*` stands for any name of a name -> object map ("policies.*").
    """
    out = {}
    for key, prop in _section(section).get("properties", {}).items():
        prop = _resolve(prop)
        if "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
    return out


POLICY_KEYS = ("rule", "tau", "eviction", "beta", "delay")
# v2's fields (docs/policy-semantics.md): a normalized policy carries one only where it differs
# from the default, so every v1 policy keeps its exact params (and its jobs are not rerun)
V2_POLICY_KEYS = ("prefetch", "route_bias", "light_miss", "substitute_by")
POLICY_DEFAULTS: dict[str, Any] = schema_defaults("policies.*")
# The engine's reserved policy name: every expert in fast memory (the floor on time per token).
# It may be listed in engine.policies / engine.bench.policies but not defined under policies:.
ALL_RESIDENT = "all_resident"
ALL_RESIDENT_POLICY: dict[str, Any] = {
    "rule": "fetch_all",
    **{key: POLICY_DEFAULTS[key] for key in POLICY_KEYS if key != "rule"},
}
# Stages that run a model online (stage -> its config keys): an offline eviction (belady)
# cannot run there.
ONLINE_STAGES = {
    "emulate": ("emulate",),
    "generate": ("generate",),
    "engine": ("engine",),
    "engine_bench": ("engine", "bench"),
}
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
    """A full `{rule, tau, eviction, beta, delay}` dict (defaults filled), checked, plus each v2
    key (`V2_POLICY_KEYS`) whose value is not its default."""
    where = f"policies.{name}"
    unknown = sorted(set(spec) - set(POLICY_KEYS) - set(V2_POLICY_KEYS))
    if unknown:
        allowed = [*POLICY_KEYS, *V2_POLICY_KEYS]
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {allowed}")
    if "rule" not in spec:
        raise ValueError(f"{where}.rule is required (one of {list(RULES)})")
    policy = {**POLICY_DEFAULTS, **spec}
    if policy["rule"] not in RULES:
        raise ValueError(f"{where}.rule={policy['rule']!r} is not one of {list(RULES)}")
    if policy["eviction"] not in EVICTIONS + OFFLINE_EVICTIONS:
        raise ValueError(
            f"{where}.eviction={policy['eviction']!r} is not one of "
            f"{list(EVICTIONS + OFFLINE_EVICTIONS)}"
        )
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
    prefetch = policy["prefetch"]
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"{where}.prefetch={prefetch!r} must be an integer >= 0")
    bias = policy["route_bias"]
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias < 0:
        raise ValueError(f"{where}.route_bias={bias!r} must be a number >= 0")
    policy["route_bias"] = float(bias)
    out = {key: policy[key] for key in POLICY_KEYS}
    out |= {key: policy[key] for key in V2_POLICY_KEYS if policy[key] != POLICY_DEFAULTS[key]}
    try:  # the cross-field rules (belady with route_bias, ...) have one home: Policy
        Policy.from_dict(out)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return out


def is_exact_twin(policy: Mapping[str, Any], candidate: Mapping[str, Any]) -> bool:
    """`candidate` is the no-admission twin of admission policy `policy`: same rule, eviction,
    (for `threshold`) tau and v2 fields, beta 0. Only such a pair isolates the effect of
    admission."""
    return (
        candidate["beta"] == 0
        and candidate["rule"] == policy["rule"]
        and candidate["eviction"] == policy["eviction"]
        and (policy["rule"] != "threshold" or math.isclose(candidate["tau"], policy["tau"]))
        and all(
            candidate.get(key, POLICY_DEFAULTS[key]) == policy.get(key, POLICY_DEFAULTS[key])
            for key in V2_POLICY_KEYS
        )
    )


def twin_spec(policy: Mapping[str, Any]) -> str:
    """The config line of an admission policy's exact twin (for messages)."""
    tau = f", tau: {number_label(policy['tau'])}" if policy["rule"] == "threshold" else ""
    v2 = "".join(f", {key}: {policy[key]}" for key in V2_POLICY_KEYS if key in policy)
    return f"{{rule: {policy['rule']}{tau}, eviction: {policy['eviction']}{v2}}}"


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
    `sweeps.beta = {base, values}` adds `<base>_beta<v>` = the `base` policy with `beta=v`;
    `sweeps.route_bias` adds `cache_prior_<v>` (route_bias v), `sweeps.prefetch` `prefetch_<v>`
    (prefetch v); `sweeps.belady = [names]` adds `<name>_belady` (eviction belady, the offline
    bound of every policy listed, sweep policies included).
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
    names = {
        "tau": lambda base, v: f"rule_tau{v}",
        "beta": lambda base, v: f"{base}_beta{v}",
        "route_bias": lambda base, v: f"cache_prior_{v}",
        "prefetch": lambda base, v: f"prefetch_{v}",
    }
    for key, sweep_name in names.items():
        sweep = sweeps.get(key)
        if not sweep:
            continue
        base = sweep.get("base")
        if base not in out:
            raise ValueError(f"sweeps.{key}.base={base!r} is not a policy in policies:")
        for value in sweep.get("values", []):
            name = sweep_name(base, number_label(value))
            if name in out:
                raise ValueError(f"sweeps.{key}: policy {name!r} already exists")
            spec = {**out[base], key: value}
            if key == "tau":
                spec["rule"] = "threshold"
            out[name] = normalize_policy(name, spec)
    for base in sweeps.get("belady") or []:
        if base not in out:
            raise ValueError(f"sweeps.belady: {base!r} is not a policy in policies: or a sweep")
        name = f"{base}_belady"
        if name in out:
            raise ValueError(f"sweeps.belady: policy {name!r} already exists")
        out[name] = normalize_policy(name, {**out[base], "eviction": "belady"})
    return out


def is_offline(policy: Mapping[str, Any]) -> bool:
    """The policy needs the future (eviction belady): it runs in simulate only."""
    return policy["eviction"] in OFFLINE_EVICTIONS


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
    list is null (the library's own study set). `analysis.baseline` must be a policy. A null
    list of an online stage (`ONLINE_STAGES`) leaves the offline (belady) policies out; listing
    one there is an error. Warns (UserWarning) for every emulated admission policy without its
    exact twin.
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
    for stage, keys in ONLINE_STAGES.items():
        offline = [n for n in out[stage] or [] if n in policies and is_offline(policies[n])]
        if offline and names(*keys, "policies") is not None:
            raise ValueError(
                f"{'.'.join(keys)}.policies: {offline} use eviction 'belady', the offline bound "
                "(it needs the future): list them under simulate only"
            )
        if out[stage] is not None:
            out[stage] = [n for n in out[stage] if n not in offline]
    baseline = names("analysis", "baseline")
    if baseline is not None:
        policy_subset(policies, [baseline], "analysis.baseline")
    # a warning, not an error: a run may leave a twin out on purpose (the analysis then reports
    # that admission effect as missing, with this reason)
    for message in missing_admission_twins(policies, out["emulate"]):
        warnings.warn(f"emulate.policies: {message}", UserWarning, stacklevel=2)
    return out


def check_checkpoint_dir(path: str | Path, where: str) -> Path:
    """`path` is a checkpoint directory holding config.json; errors say what it is instead."""
    path = Path(path)
    if path.is_file():
        raise ValueError(
            f"{where}: {str(path)!r} is a file; give the checkpoint directory that holds it "
            f"({str(path.parent)!r})"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"{where}: checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{where}: {str(path / 'config.json')!r} not found (not a Hugging Face checkpoint)"
        )
    return path


def read_checkpoint_geometry(path: str | Path, where: str) -> tuple[int, int]:
    """(E, k) from a Hugging Face checkpoint's config.json (text_config for multimodal ones)."""
    cfg_path = check_checkpoint_dir(path, where) / "config.json"
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
        emb = {**schema_defaults("embedded"), **(config.get("embedded") or {})}
        return int(emb["num_experts"]), int(emb["num_experts_per_tok"])
    return read_checkpoint_geometry(spec["path"], f"models.{name}.path")


def expb_min_capacity(top_k: int) -> int:
    """The smallest resident set Experiment B can draw substitutes from: a token may have k - 1
    substituted ranks, each needing a resident not among its k computed experts (C >= 2k - 1)."""
    return 2 * top_k - 1


def check_capacities(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every capacity rule of the pipeline, per model, naming the key; returns model -> (E, k).

    C = `moesub.policy.capacity_for(fraction, E)`. Every cache fraction (`fractions`,
    `expb.fraction` and the regime's fixed 25%) must give k <= C <= E; Experiment B's substitute
    pool (`expb.fraction`'s C, or E with `expb.resident: all`) must hold 2k - 1 experts; the
    engine benchmark's own geometry (`engine.bench`) must give k <= C <= E.
    """
    geometry = {}
    fractions = [(f"fractions[{i}]", f) for i, f in enumerate(config["fractions"])]
    expb = config.get("expb") or {}
    if expb.get("fraction") is not None:
        fractions.append(("expb.fraction", expb["fraction"]))
    fractions.append(("the regime's fixed fraction (moesub.regime)", REGIME_FRACTION))
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
        model = f"model {name!r} (E={num_experts}, k={top_k} from {source})"
        for label, fraction in fractions:
            cap = capacity_for(fraction, num_experts)
            if cap < top_k:
                raise ValueError(
                    f"{label}={fraction} gives capacity C={cap} < k={top_k} for {model}: "
                    "C = floor(fraction * E + 0.5) must be >= k"
                )
            if cap > num_experts:
                raise ValueError(f"{label}={fraction} gives C={cap} > E={num_experts}")
        if expb:
            every_expert = expb.get("resident") == "all"
            fraction = expb.get("fraction", schema_defaults("expb")["fraction"])
            pool = num_experts if every_expert else capacity_for(fraction, num_experts)
            need = expb_min_capacity(top_k)
            if pool < need:
                key = "expb.resident: all" if every_expert else f"expb.fraction={fraction}"
                raise ValueError(
                    f"{key} gives Experiment B a substitute pool of {pool} experts per layer for "
                    f"{model}; it needs C >= 2k - 1 = {need} (a token may have k - 1 substituted "
                    f"ranks, each replaced by a resident outside its k computed experts): raise "
                    f"expb.fraction to >= {need / num_experts:.3g}"
                )
        geometry[name] = (num_experts, top_k)
    b = {**schema_defaults("engine.bench"), **((config.get("engine") or {}).get("bench") or {})}
    if b["enabled"]:
        cap = capacity_for(b["fraction"], b["num_experts"])
        if not b["top_k"] <= cap <= b["num_experts"]:
            raise ValueError(
                f"engine.bench.fraction={b['fraction']} gives the benchmark capacity C={cap} "
                f"outside [k={b['top_k']}, E={b['num_experts']}] (engine.bench.top_k, "
                "engine.bench.num_experts)"
            )
    return geometry


def input_paths(config: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(key, path, kind) of every local input the config names; kind: "file", "dir" or
    "checkpoint" (a Hugging Face checkpoint directory).

    Each is checked at parse time (`check_input_paths`) and is an input of the rule that reads
    it (workflow/rules/common.smk), so that editing the path re-plans that rule: Snakemake drops
    a job whose input is missing but whose outputs exist, and would silently keep old results.
    """
    out = [
        (f"models.{name}.path", spec["path"], "checkpoint")
        for name, spec in config["models"].items()
        if spec.get("path")
    ]
    source = config["streams"]["source"]
    if source["kind"] == "text":
        out += [(f"streams.source.{k}", source.get(k), "file") for k in ("path", "calib_path")]
    elif source["kind"] == "embedded":
        out.append(("streams.source.root", source.get("root"), "dir"))
    elif source["kind"] == "datasets" and _local_name(source["name"]):
        out.append(("streams.source.name", source["name"], "dir"))
    for task, spec in ((config.get("generate") or {}).get("tasks") or {}).items():
        out.append((f"generate.tasks.{task}.path", (spec or {}).get("path"), "file"))
    return [(key, str(path), kind) for key, path, kind in out if path]


def _local_name(name: str) -> bool:
    """A `datasets` source name that is a local save_to_disk directory, not a Hub name."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def check_input_paths(config: Mapping[str, Any]) -> None:
    """Every input path of the config exists and is of its kind; errors name the key."""
    for key, path, kind in input_paths(config):
        p = Path(path).expanduser()
        if kind == "checkpoint":
            check_checkpoint_dir(p, key)
        elif not p.exists():
            raise FileNotFoundError(
                f"{key}: {path!r} does not exist (relative paths are relative to the directory "
                f"Snakemake runs in, {str(Path.cwd())!r})"
            )
        elif kind == "file" and not p.is_file():
            raise ValueError(f"{key}: {path!r} is a directory; give a file")
        elif kind == "dir" and not p.is_dir():
            raise ValueError(f"{key}: {path!r} is a file; give a directory")


def fill_defaults(config: dict[str, Any], node: Mapping[str, Any] | None = None) -> None:
    """Fill the schema's defaults into a validated `config` in place, as Snakemake's `validate`
    does: absent keys with a default get it; present objects are filled recursively."""
    node = _resolve(config_schema() if node is None else node)
    for key, prop in node.get("properties", {}).items():
        prop = _resolve(prop)
        if key not in config and "default" in prop:
            config[key] = copy.deepcopy(prop["default"])
        if isinstance(config.get(key), dict):
            fill_defaults(config[key], prop)


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
    schema = (
        config_schema() if schema_path is None else yaml.safe_load(Path(schema_path).read_text())
    )
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        key = ".".join(str(p) for p in err.absolute_path) or "<top level>"
        raise ValueError(f"config {str(path)!r}: {key}: {err.message}")
    fill_defaults(config)
    stage_policies(config, expand_policies(config))
    check_capacities(config)
    check_input_paths(config)
    return config
