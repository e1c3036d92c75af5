"""The study's policies: normalized from config, expanded by sweeps, selected per stage.

`expand_policies` turns `policies:` and `sweeps:` into name -> full policy dict (defaults from
the schema; every field's rule is `moesub.vocabulary.Policy`'s); `stage_policies` checks each
stage's `policies:` list against them; the admission twins (`is_exact_twin`) pair each admission
policy with the run that isolates its effect.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from moesub.config.names import check_name, number_label
from moesub.config.schema import schema_defaults, schema_section
from moesub.slots import LAYOUT_KEYS, check_pin_spec
from moesub.vocabulary import ALL_RESIDENT, OFFLINE_EVICTIONS, Policy

POLICY_KEYS = ("rule", "tau", "eviction", "beta", "delay")
# v2's fields and v3's host_admit (docs/policy-semantics.md): a normalized policy carries one only
# where it differs from the default, so every v1 policy keeps its exact params (and its jobs are
# not rerun); v3's pin is a layout key (`moesub.slots.LAYOUT_KEYS`), resolved per layer
V2_POLICY_KEYS = ("prefetch", "route_bias", "light_miss", "substitute_by", "host_admit")
POLICY_DEFAULTS: dict[str, Any] = schema_defaults("policies.*")
# Stages that run a model online (stage -> its config keys): an offline eviction (belady)
# cannot run there.
ONLINE_STAGES = {
    "emulate": ("emulate",),
    "generate": ("generate",),
    "engine": ("engine",),
    "engine_bench": ("engine", "bench"),
}


def policy_spec(policy: Policy, layout: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A policy as the config holds it after `normalize_policy`: every v1 key
    (`POLICY_KEYS`), plus each v2 key (`V2_POLICY_KEYS`) and layout key (`pin`, `allocation`:
    `moesub.layout.LAYOUT_KEYS`, from `layout`) whose value is not its default.
    These dicts are the Snakemake params of the policy's jobs."""
    fields = policy.to_dict()
    out = {key: fields[key] for key in POLICY_KEYS}
    out |= {key: fields[key] for key in V2_POLICY_KEYS if fields[key] != POLICY_DEFAULTS[key]}
    return out | {k: v for k, v in (layout or {}).items() if v != POLICY_DEFAULTS[k]}


def normalize_policy(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`policy_spec` of the `Policy` that `spec` (the schema's defaults filled) makes, with its
    layout keys (pin spec, allocation) checked; errors are raised naming
    `policies.<name>.<key>`."""
    where = f"policies.{name}"
    missing = [key for key in schema_section("policies.*")["required"] if key not in spec]
    if missing:
        raise ValueError(f"{where}: missing required key(s) {missing}")
    fields = {**POLICY_DEFAULTS, **spec}
    layout = {key: fields.pop(key) for key in LAYOUT_KEYS}
    try:
        check_pin_spec(layout["pin"])
        policy = Policy.from_dict(fields)
    except ValueError as e:  # "[policy ]<field>: <problem>" -> "policies.<name>.<field>: ..."
        field, _, problem = str(e).partition(": ")
        key = field.removeprefix("policy").strip()
        raise ValueError(f"{where}{'.' + key if key else ''}: {problem}") from None
    return policy_spec(policy, layout)


def is_exact_twin(policy: Mapping[str, Any], candidate: Mapping[str, Any]) -> bool:
    """`candidate` is the no-admission twin of admission policy `policy`: same rule, eviction,
    (for `threshold`) tau, v2 fields and layout (pin, allocation), beta 0. Only such a pair
    isolates the effect of admission."""
    return (
        candidate["beta"] == 0
        and candidate["rule"] == policy["rule"]
        and candidate["eviction"] == policy["eviction"]
        and (policy["rule"] != "threshold" or math.isclose(candidate["tau"], policy["tau"]))
        and all(
            candidate.get(key, POLICY_DEFAULTS[key]) == policy.get(key, POLICY_DEFAULTS[key])
            for key in (*V2_POLICY_KEYS, *LAYOUT_KEYS)
        )
    )


def twin_spec(policy: Mapping[str, Any]) -> str:
    """The config line of an admission policy's exact twin (for messages)."""
    tau = f", tau: {number_label(policy['tau'])}" if policy["rule"] == "threshold" else ""
    v2 = "".join(
        f", {key}: {policy[key]}" for key in (*V2_POLICY_KEYS, *LAYOUT_KEYS) if key in policy
    )
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
            out.append(
                f"{name} has no exact no-admission twin (add a policy {twin_spec(pol)}): "
                "its admission effect will not be measured"
            )
    return out


def expand_policies(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Named policies plus sweep policies, name -> full policy dict, in a stable order.

    `sweeps.tau = {base, values}` adds `rule_tau<v>` = the `base` policy with `tau=v`;
    `sweeps.beta = {base, values}` adds `<base>_beta<v>` = the `base` policy with `beta=v`;
    `sweeps.route_bias` adds `cache_prior_<v>` (route_bias v), `sweeps.prefetch` `prefetch_<v>`
    (prefetch v); `sweeps.belady = [names]` adds `<name>_belady` (eviction belady, the offline
    bound of every policy listed, sweep policies included); `sweeps.allocation = [names]` adds
    `<name>_planned` (allocation planned: per-layer slots chosen on the calibration capture).
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
    for base in sweeps.get("allocation") or []:
        if base not in out:
            raise ValueError(f"sweeps.allocation: {base!r} is not a policy in policies: or a sweep")
        if out[base].get("allocation") == "planned":
            raise ValueError(f"sweeps.allocation: {base!r} is already planned")
        name = f"{base}_planned"
        if name in out:
            raise ValueError(f"sweeps.allocation: policy {name!r} already exists")
        out[name] = normalize_policy(name, {**out[base], "allocation": "planned"})
    return out


def is_planned(policy: Mapping[str, Any]) -> bool:
    """The policy's per-layer slots are planned (`allocation: planned`)."""
    return policy.get("allocation") == "planned"


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
    list is null (the library's own study set); `generate.tasks.<task>` is a task's own list
    where it has one (else it runs generate's). `analysis.baseline` must be a policy. A null
    list of an online stage (`ONLINE_STAGES`) leaves the offline (belady) policies out; listing
    one there is an error. Planned policies (`allocation: planned`) are an error in
    `engine.bench.policies` (its caches are uniform). Warns (UserWarning) for every emulated
    admission policy without its exact twin.
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
    # a generation task may run its own list (the continuation, which measures degeneration,
    # adds the runtimes' designs); key "generate.tasks.<task>", absent = generate's list
    task_keys = {}
    for task, spec in (names("generate", "tasks") or {}).items():
        if (spec or {}).get("policies") is not None:
            where = ("generate", "tasks", task)
            out[".".join(where)] = policy_subset(
                policies, spec["policies"], ".".join(where) + ".policies"
            )
            task_keys[".".join(where)] = where
    out["engine"] = policy_subset(
        policies, names("engine", "policies"), "engine.policies", extra=(ALL_RESIDENT,)
    )
    bench = names("engine", "bench", "policies")
    out["engine_bench"] = (
        None
        if bench is None
        else policy_subset(policies, bench, "engine.bench.policies", extra=(ALL_RESIDENT,))
    )
    for stage, keys in {**ONLINE_STAGES, **task_keys}.items():
        offline = [n for n in out[stage] or [] if n in policies and is_offline(policies[n])]
        if offline and names(*keys, "policies") is not None:
            raise ValueError(
                f"{'.'.join(keys)}.policies: {offline} use eviction 'belady', the offline bound "
                "(it needs the future): list them under simulate only"
            )
        if out[stage] is not None:
            out[stage] = [n for n in out[stage] if n not in offline]
    # the engine bench lays out its own synthetic-size caches, uniform (a planned layout is
    # planned on a model's calibration capture, which the bench's geometry has none of)
    planned = [n for n in out["engine_bench"] or [] if n in policies and is_planned(policies[n])]
    if planned:
        raise ValueError(
            f"engine.bench.policies: {planned} have planned per-layer slot counts, planned on a "
            "model's calibration capture; the benchmark's caches are uniform: list them under "
            "engine.policies (the pipeline's engine runs planned layouts)"
        )
    baseline = names("analysis", "baseline")
    if baseline is not None:
        policy_subset(policies, [baseline], "analysis.baseline")
    # a warning, not an error: a run may leave a twin out on purpose (the analysis then reports
    # that admission effect as missing, with this reason)
    for message in missing_admission_twins(policies, out["emulate"]):
        warnings.warn(f"emulate.policies: {message}", UserWarning, stacklevel=2)
    return out
