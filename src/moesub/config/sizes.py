"""Cache sizes per model and every capacity rule the config must satisfy.

Every configured size (`fractions`, `budgets`) resolves per model to C slots per layer
(`moesub.layout.resolve_size`: a budget through the model's pricing geometry and
`expert_bits`); `model_sizes` checks k <= C <= E and that no two sizes give the same C.
`stage_sizes` says which sizes each stage runs at (simulate: every size), `regime_size` the
regime's, `check_pins` every policy's pin spec at every size, and `check_capacities` the rest
(Experiment B's pool, the engine benchmark's size). Everything runs at parse time, each error
naming its key (`budgets[1]`, `emulate.sizes[0]`, `policies.<name>.pin`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moesub.config.geometry import expb_min_capacity, model_geometry, pricing_geometry
from moesub.config.names import check_name
from moesub.config.schema import schema_defaults
from moesub.slots import (
    CacheSize,
    budget_bytes,
    budget_label,
    fraction_label,
    layer_pin,
    resolve_size,
)
from moesub.vocabulary import capacity_for

# The share of E resident at which the reference study gives its regime figures: the regime is
# measured at the configured size nearest to it unless `regime.size` names one.
REGIME_FRACTION = 0.25
# Stages with a `sizes:` list (null = every size); simulate runs at every size.
SIZE_STAGES = ("emulate", "engine", "generate")


def configured_sizes(config: Mapping[str, Any]) -> list[tuple[str, float | str]]:
    """(key, value) of every configured size: fractions first, then budgets, in config order."""
    return [(f"fractions[{i}]", f) for i, f in enumerate(config.get("fractions") or [])] + [
        (f"budgets[{i}]", b) for i, b in enumerate(config.get("budgets") or [])
    ]


def size_labels(config: Mapping[str, Any]) -> list[str]:
    """The size labels (path components) of every configured size: f<fraction>, b<budget>."""
    return [
        budget_label(v) if isinstance(v, str) else fraction_label(v)
        for _, v in configured_sizes(config)
    ]


def expert_bits(config: Mapping[str, Any], name: str) -> float:
    """Model `name`'s expert precision: `models.<name>.expert_bits`, else the top-level one."""
    own = config["models"][name].get("expert_bits")
    return float(own if own is not None else config.get("expert_bits", 16))


def resolve_for_model(
    config: Mapping[str, Any], name: str, key: str, value: float | str
) -> CacheSize:
    """One size (`key` = where the config gives it) resolved for model `name`, checked to give
    k <= C <= E; the error says how a budget was priced."""
    num_experts, top_k = model_geometry(config, name)
    # only a budget needs the experts' weight (a checkpoint without expert shapes takes fractions)
    pricing = pricing_geometry(config, name) if isinstance(value, str) else None
    bits = expert_bits(config, name)
    try:
        size = resolve_size(value, num_experts, pricing, bits)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    if top_k <= size.capacity <= num_experts:
        return size
    if pricing is not None:
        why = (
            f"a budget buys C = floor(budget / expert_bytes / L) = floor({budget_bytes(value)} B "
            f"/ {pricing.expert_bytes(bits):.0f} B / {pricing.moe_layers}) slots per layer at "
            f"{bits:g} bits per weight, priced at the {pricing.source}"
        )
    else:
        why = "C = floor(fraction * E + 0.5)"
    side = f"< k={top_k}" if size.capacity < top_k else f"> E={num_experts}"
    source = (
        "embedded.num_experts / embedded.num_experts_per_tok"
        if config["models"][name].get("embedded")
        else f"config.json of models.{name}.path"
    )
    raise ValueError(
        f"{key}={value!r} gives capacity C={size.capacity} {side} for model {name!r} "
        f"(E={num_experts}, k={top_k} from {source}): {why}"
    )


def model_sizes(config: Mapping[str, Any], name: str) -> dict[str, CacheSize]:
    """label -> the size resolved for model `name`, every configured size; no two may give the
    same C (the analysis keys a size by its share of E)."""
    out: dict[str, CacheSize] = {}
    where: dict[int, str] = {}
    for key, value in configured_sizes(config):
        size = resolve_for_model(config, name, key, value)
        if size.capacity in where:
            raise ValueError(
                f"{key}={value!r} gives model {name!r} C={size.capacity} slots per layer, as "
                f"{where[size.capacity]} does: the same cache size twice (drop one)"
            )
        where[size.capacity] = f"{key}={value!r}"
        out[size.label] = size
    return out


def _label_of(config: Mapping[str, Any], key: str, value: float | str) -> str:
    """The label of the configured size `value` names (a fraction of `fractions`, a budget of
    `budgets`, compared in bytes)."""
    labels = dict(zip([v for _, v in configured_sizes(config)], size_labels(config), strict=True))
    if isinstance(value, str):
        nbytes = budget_bytes(value)
        match = [v for v in labels if isinstance(v, str) and budget_bytes(v) == nbytes]
    else:
        match = [v for v in labels if not isinstance(v, str) and v == value]
    if not match:
        raise ValueError(
            f"{key}={value!r} is not a configured size (fractions, budgets): {list(labels)}"
        )
    return labels[match[0]]


def stage_sizes(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """The size labels each stage runs at: simulate every size; emulate, engine and generation
    their `sizes:` list (null = every size), each entry a configured fraction or budget."""
    every = size_labels(config)
    out = {"simulate": every}
    for stage in SIZE_STAGES:
        chosen = (config.get(stage) or {}).get("sizes")
        out[stage] = (
            every
            if chosen is None
            else [_label_of(config, f"{stage}.sizes[{i}]", v) for i, v in enumerate(chosen)]
        )
    return out


def regime_size(config: Mapping[str, Any], name: str) -> CacheSize:
    """The size model `name`'s regime is measured at: `regime.size`, else the configured size
    whose share of E is nearest the study's 25% resident (the first of equals)."""
    value = (config.get("regime") or {}).get("size")
    if value is not None:
        return resolve_for_model(config, name, "regime.size", value)
    num_experts, _ = model_geometry(config, name)
    sizes = list(model_sizes(config, name).values())
    return min(sizes, key=lambda s: abs(s.capacity / num_experts - REGIME_FRACTION))


def check_pins(config: Mapping[str, Any], policies: Mapping[str, Mapping[str, Any]]) -> None:
    """Every policy's pin spec at every size of every model (uniform slots: a planned
    allocation keeps each layer at or above the smallest C_l its pins allow), and every engine
    benchmark policy's at the benchmark's C, leaves a token's experts their slots:
    pin + max(k, prefetch) <= C."""
    checks = []  # (where, capacity, k, policy names)
    for name in config["models"]:
        _, top_k = model_geometry(config, name)
        for size in model_sizes(config, name).values():
            checks.append((f"size {size.label} of model {name!r}", size.capacity, top_k, policies))
    bench = {**schema_defaults("engine.bench"), **((config.get("engine") or {}).get("bench") or {})}
    if bench["enabled"] and bench.get("policies"):
        capacity = capacity_for(bench["fraction"], bench["num_experts"])
        named = [n for n in bench["policies"] if n in policies]
        checks.append((f"the engine benchmark's C={capacity}", capacity, bench["top_k"], named))
    for where, capacity, top_k, names in checks:
        for policy in names:
            spec = policies[policy]
            try:
                layer_pin(spec.get("pin", 0), capacity, top_k, spec.get("prefetch", 0))
            except ValueError as e:
                raise ValueError(f"policies.{policy}.pin at {where}: {e}") from None


def check_capacities(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """Every capacity rule of the pipeline, per model, naming the key; returns model -> (E, k).

    Every cache size (`model_sizes`) and `regime.size` must give k <= C <= E; `expb.fraction`
    too, and Experiment B's substitute pool (its C, or E with `expb.resident: all`) must hold
    2k - 1 experts; the engine benchmark's own geometry (`engine.bench`) must give k <= C <= E.
    """
    geometry = {}
    expb = config.get("expb") or {}
    for name in config["models"]:
        check_name(name, f"models.{name}")
        num_experts, top_k = model_geometry(config, name)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model {name!r}: top-k {top_k} must be in [1, E={num_experts}]")
        model_sizes(config, name)
        regime_size(config, name)
        if expb:
            _check_expb(expb, config, name, num_experts, top_k)
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


def _check_expb(
    expb: Mapping[str, Any], config: Mapping[str, Any], name: str, num_experts: int, top_k: int
) -> None:
    """Experiment B's resident set (`expb.fraction`, uniform) and substitute pool for a model."""
    fraction = expb.get("fraction", schema_defaults("expb")["fraction"])
    resolve_for_model(config, name, "expb.fraction", fraction)
    every_expert = expb.get("resident") == "all"
    pool = num_experts if every_expert else capacity_for(fraction, num_experts)
    need = expb_min_capacity(top_k)
    if pool < need:
        key = "expb.resident: all" if every_expert else f"expb.fraction={fraction}"
        raise ValueError(
            f"{key} gives Experiment B a substitute pool of {pool} experts per layer for model "
            f"{name!r} (E={num_experts}, k={top_k}); it needs C >= 2k - 1 = {need} (a token may "
            f"have k - 1 substituted ranks, each replaced by a resident outside its k computed "
            f"experts): raise expb.fraction to >= {need / num_experts:.3g}"
        )
    factorial = {**schema_defaults("expb.designs.factorial"),
                 **((expb.get("designs") or {}).get("factorial") or {})}  # fmt: skip
    if factorial["enabled"] and factorial["high_ranks"][1] > top_k:
        raise ValueError(
            f"expb.designs.factorial.high_ranks={factorial['high_ranks']} reaches past the "
            f"router's top-k for model {name!r}, k={top_k}: ranks run 2..k (or set enabled: false)"
        )
