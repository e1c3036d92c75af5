"""The policy vocabulary in plain Python: what a policy is, what the core reports, capacities.

Nothing here loads the C++ core (`moesub._core`) or torch, so the config (`moesub.config`)
parses without them. `moesub.policy` (the stable API) re-exports every name beside the
core-facing `scan` and `LayerCache`. Semantics: docs/policy-semantics.md.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# The core's status codes (csrc/policy.hpp `Status`); STATUS_NAMES[code] names each one in
# every artefact's per-status counts.
HIT, FETCH, SUB, HOST, FORCED = 0, 1, 2, 3, 4
STATUS_NAMES = ("hit", "fetch", "sub", "host", "forced")
# What a policy did at one token-layer, as counts (the pricing's input, `moesub.policy.
# token_layer_counts`): experts per status, experts inserted by prefetch (step 1b), background
# copies requested (beta admissions and host uploads) and admissions landed (step 1).
TOKEN_LAYER_FIELDS = (*STATUS_NAMES, "prefetched", "admission_requests", "admissions")
RULES = ("fetch_all", "substitute_all", "first_choice", "threshold", "host_compute")
EVICTIONS = ("lru", "lfu")  # online evictions: every stage, the streaming form included
OFFLINE_EVICTIONS = ("belady",)  # needs the whole future: scan and the simulator only
LIGHT_MISSES = ("substitute", "host")  # what the light misses a rule would substitute do
SUBSTITUTE_BY = ("logit", "coactivation")  # step 5's candidate ranking
# Reserved policy name: every expert resident (the engine's floor on time per token). It may
# be listed in engine.policies / engine.bench.policies but not defined under policies:.
ALL_RESIDENT = "all_resident"
# The study's named policies, for code that runs without a config (the engine benchmark's
# default set, the regime measurement); config.yaml `policies:` defines the same (a test holds
# them equal).
STUDY_POLICIES: dict[str, dict[str, Any]] = {
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "substitute_all": {"rule": "substitute_all", "eviction": "lru"},
    "rule_015": {"rule": "threshold", "tau": 0.15, "eviction": "lru"},
    "first_choice": {"rule": "first_choice", "eviction": "lru"},
    "quality": {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5},
    "speed": {"rule": "first_choice", "eviction": "lfu", "beta": 0.5},
    "host_compute": {"rule": "host_compute", "eviction": "lru"},
}


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"policy {field}: unknown value {value!r}; expected one of {allowed}")


def _number(field: str, value: Any) -> float:
    """A finite real number >= 0 (bool is not a number here), as float."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value >= 0):
        raise ValueError(f"policy {field}: must be a finite number >= 0, got {value!r}")
    return float(value)


def _integer(field: str, value: Any, minimum: int) -> int:
    """An integer >= minimum (1.0 and True are not integers here), as int."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not (ok and value >= minimum):
        raise ValueError(f"policy {field}: must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _pin(value: Any) -> int | tuple[int, ...]:
    """An int >= 0 (every layer) or a sequence of them (one per MoE layer, stored as a tuple)."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            raise ValueError("policy pin: a per-layer pin needs one integer per MoE layer, got []")
        return tuple(_integer("pin", v, 0) for v in value)
    return _integer("pin", value, 0)


@dataclass(frozen=True)
class Policy:
    """A miss rule, an eviction order and (beta > 0) background admission; v2 adds prefetch,
    cache-aware routing, host-computed light misses and co-activation substitutes (defaults: v1);
    v3 adds pinned experts and uploads of host-computed misses (defaults: v2).

    Every field's rule lives here, the config's included (`moesub.config.normalize_policy` only
    fills defaults and builds a Policy). Numbers are stored as float, counts as int. Rules that
    need the cache's size (prefetch and pin against C) are `check_fit`'s, per layer.
    """

    rule: str = "fetch_all"
    tau: float = 0.0  # threshold rule only (> 0 there): fetch a miss whose gate weight is >= tau
    eviction: str = "lru"
    beta: float = 0.0  # admit an expert once its substituted mass reaches beta; 0 = never
    delay: int = 1  # tokens between an admission request and the expert becoming resident
    prefetch: int = 0  # experts prefetched per token from the lookahead logits (step 1b)
    route_bias: float = 0.0  # lambda: residents' logits + lambda * (max - min) in selection
    light_miss: str = "substitute"  # "host": what the rule would substitute runs on the host
    substitute_by: str = "logit"  # "coactivation": the resident most co-selected with the miss
    # pinned: the first `pin` experts of each layer's initial set are never evicted; an int for
    # every layer or a tuple of one int per MoE layer (`for_layer`)
    pin: int | tuple[int, ...] = 0
    host_admit: int = 0  # host-computed misses uploaded in the background per token-layer

    def __post_init__(self) -> None:
        _choice("rule", self.rule, RULES)
        _choice("eviction", self.eviction, EVICTIONS + OFFLINE_EVICTIONS)
        _choice("light_miss", self.light_miss, LIGHT_MISSES)
        _choice("substitute_by", self.substitute_by, SUBSTITUTE_BY)
        canonical = {
            "tau": _number("tau", self.tau),
            "beta": _number("beta", self.beta),
            "route_bias": _number("route_bias", self.route_bias),
            "delay": _integer("delay", self.delay, 1),
            "prefetch": _integer("prefetch", self.prefetch, 0),
            "pin": _pin(self.pin),
            "host_admit": _integer("host_admit", self.host_admit, 0),
        }
        for name, value in canonical.items():  # frozen: set through object
            object.__setattr__(self, name, value)
        if self.rule == "threshold" and self.tau <= 0:
            # tau = 0 would fetch every miss: that policy is rule fetch_all
            raise ValueError("policy tau: rule 'threshold' needs tau > 0 (tau = 0 is fetch_all)")
        if self.rule == "host_compute" and self.beta > 0:
            raise ValueError("policy beta: host_compute never changes the cache; beta must be 0")
        if self.light_miss == "host" and self.beta > 0:
            raise ValueError(
                "policy beta: with light_miss='host' nothing is substituted, so nothing is ever "
                "admitted; beta must be 0"
            )
        if self.host_admit > 0 and not (self.rule == "host_compute" or self.light_miss == "host"):
            raise ValueError(
                "policy host_admit: uploads host-computed misses, so it needs a policy that "
                "computes misses on the host (rule 'host_compute' or light_miss='host')"
            )
        if self.eviction == "belady" and self.route_bias > 0:
            raise ValueError(
                "policy eviction: 'belady' needs the future selections, which route_bias > 0 "
                "makes depend on the cache; use route_bias=0 or an online eviction"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"policy: unknown key(s) {sorted(unknown)}; expected {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def layer_pins(self, num_layers: int) -> tuple[int, ...]:
        """`pin` of each of `num_layers` MoE layers (a per-layer pin must have that length)."""
        if isinstance(self.pin, int):
            return (self.pin,) * num_layers
        if len(self.pin) != num_layers:
            raise ValueError(
                f"policy pin: {len(self.pin)} per-layer values for {num_layers} MoE layers"
            )
        return self.pin

    def for_layer(self, layer: int) -> Policy:
        """The policy of MoE layer `layer`, its pin an int (a per-layer pin's entry)."""
        if isinstance(self.pin, int):
            return self
        if not 0 <= layer < len(self.pin):
            raise ValueError(f"policy pin: no value for layer {layer} ({len(self.pin)} layers)")
        return replace(self, pin=self.pin[layer])

    def check_fit(self, k: int, capacity: int, layer: int | None = None) -> None:
        """The policy fits a layer of `capacity` slots with top-`k` routing: prefetch <= C and
        pin + max(k, prefetch) <= C (so a victim always exists). Needs an int pin
        (`for_layer`); `layer` names the layer in the error."""
        if not isinstance(self.pin, int):
            raise ValueError("policy pin: a per-layer pin; take the layer's policy (for_layer)")
        where = "" if layer is None else f" in layer {layer}"
        if self.prefetch > capacity:
            raise ValueError(
                f"policy prefetch: n={self.prefetch} exceeds the capacity C={capacity}{where}"
            )
        if self.pin + max(k, self.prefetch) > capacity:
            raise ValueError(
                f"policy pin: pin={self.pin} + max(k={k}, prefetch={self.prefetch}) exceeds the "
                f"capacity C={capacity}{where} (pin + max(k, prefetch) <= C leaves a victim)"
            )

    def _core_args(self) -> tuple[int, float, int, float, int, int, float, int, int, int]:
        """The fields as `moesub._core` takes them (choices by index); the pin goes per layer."""
        return (
            RULES.index(self.rule),
            self.tau,
            (EVICTIONS + OFFLINE_EVICTIONS).index(self.eviction),
            self.beta,
            self.delay,
            self.prefetch,
            self.route_bias,
            LIGHT_MISSES.index(self.light_miss),
            SUBSTITUTE_BY.index(self.substitute_by),
            self.host_admit,
        )


# Every expert resident: no miss ever happens, so the rule never acts (the engine's floor, the
# gate weights of a whole trace).
ALL_RESIDENT_POLICY = Policy(rule="fetch_all")


def capacity_for(fraction: float, num_experts: int) -> int:
    """Resident experts per layer for a cache fraction: C = floor(fraction * E + 0.5) (the
    project's one capacity formula)."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise ValueError(f"fraction: must be a number in (0, 1], got {fraction!r}")
    if not (0 < fraction <= 1):
        raise ValueError(f"fraction: must be in (0, 1], got {fraction!r}")
    return int(math.floor(fraction * num_experts + 0.5))


def check_capacity(fraction: float, num_experts: int, k: int) -> int:
    """`capacity_for(fraction, E)`, checked to hold k <= C <= E (the core needs k slots)."""
    capacity = capacity_for(fraction, num_experts)
    if not k <= capacity <= num_experts:
        raise ValueError(
            f"fraction {fraction} gives capacity C={capacity}, outside [k={k}, E={num_experts}] "
            "(C = floor(fraction * E + 0.5))"
        )
    return capacity
