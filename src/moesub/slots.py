"""Cache slots in plain Python: how many each layer has (cache sizes) and how many are pinned
(pin specs). No NumPy, no policy core, no torch: the config resolves and checks sizes and pin
specs at parse time with this code, and every stage's layout (`moesub.layout`) with the same.

- A **cache size** (`CacheSize`) is a fraction of each layer's experts (config `fractions`,
  label `f0.25`) or a byte budget for the experts of every MoE layer (config `budgets`, label
  `b10GiB`). Either resolves per model to a uniform slot count per layer C (`resolve_size`): a
  fraction by `capacity_for` (C = floor(fraction * E + 0.5)); a budget by `budget_slots`
  (C = floor(budget_bytes / expert_bytes / L)), the expert bytes from the model's *pricing
  geometry* (`PricingGeometry`: a real checkpoint's own config.json; the embedded model at the
  reference geometry, `REFERENCE_GEOMETRY`) and the storage precision `expert_bits`.
- A **pin spec** (policy key `pin`, config level) says how many of each layer's initial experts
  are never evicted: an int, a share of the layer's slots ("50%": floor(share * C_l)), or all
  but n slots ("C-k": C_l - k, "C-2": C_l - 2). `pin_count` resolves it for one layer,
  `layer_pin` checks it leaves a token's experts their slots. `pin` and `allocation` are the
  config's layout keys (`LAYOUT_KEYS`); `policy_fields` drops them from a policy dict.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from moesub.vocabulary import Policy, capacity_for

# --------------------------------------------------------------------------------------------
# cache sizes


@dataclass(frozen=True)
class PricingGeometry:
    """What a model's experts weigh: `moe_layers` MoE layers of `num_experts` experts, each three
    `hidden` x `width` matrices (gate, up, down). `source` says where the figures come from."""

    moe_layers: int
    num_experts: int
    hidden: int
    width: int
    source: str

    def expert_bytes(self, bits: float) -> float:
        """Bytes of one expert stored at `bits` per weight: 3 * hidden * width * bits / 8."""
        return float(3 * self.hidden * self.width * _exact(bits) / 8)

    def to_dict(self) -> dict[str, Any]:
        return {
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "hidden": self.hidden,
            "width": self.width,
            "source": self.source,
        }


# The embedded model (and any model without expert shapes of its own) is priced as the reference
# model whose routing geometry it copies: Qwen3-Next-80B-A3B (48 MoE layers, 512 experts of
# 2048 x 512 x 3).
REFERENCE_GEOMETRY = PricingGeometry(
    moe_layers=48,
    num_experts=512,
    hidden=2048,
    width=512,
    source="reference geometry Qwen3-Next-80B-A3B (48 MoE layers, 512 experts, hidden 2048, "
    "expert width 512)",
)
_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BYTE_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# a budget as written in config.yaml; the text itself becomes the size's label (b<text>)
BUDGET_PATTERN = r"^[0-9]+(\.[0-9]+)?(B|[KMGT]i?B)$"


def _exact(value: float | int | str) -> Fraction:
    """A number as the exact decimal it was written as (4.5 bits, "2.5" GiB)."""
    return Fraction(str(value)) if isinstance(value, str) else Fraction(repr(value))


def budget_bytes(text: str) -> int:
    """Bytes of a budget string ("10GiB" = 10 * 2**30, "500MB" = 500 * 10**6), floored."""
    match = re.match(BUDGET_PATTERN, text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"budget {text!r}: expected a number and a unit, e.g. 10GiB, 512MiB, 6GB "
            f"(units {', '.join(_BYTE_UNITS)})"
        )
    unit = match.group(2)
    return math.floor(_exact(text[: -len(unit)]) * _BYTE_UNITS[unit])


def budget_slots(budget: int, pricing: PricingGeometry, expert_bits: float) -> int:
    """Uniform slots per layer a byte budget buys: floor(budget / expert_bytes / L), exact."""
    expert = 3 * pricing.hidden * pricing.width * _exact(expert_bits) / 8
    return math.floor(Fraction(budget) / expert / pricing.moe_layers)


@dataclass(frozen=True)
class CacheSize:
    """One cache size resolved for one model: its label (the path component), the uniform slot
    count per layer C, and the share of E it holds (`fraction`: the configured fraction, or C / E
    for a budget). A budget also records how C was priced (`budget`: the text, bytes,
    expert_bits, expert_bytes and the pricing geometry)."""

    label: str
    capacity: int
    fraction: float
    budget: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The job params and artefact metadata of the size."""
        out = {"label": self.label, "capacity": self.capacity, "fraction": self.fraction}
        return out | ({"budget": dict(self.budget)} if self.budget is not None else {})

    @classmethod
    def of(cls, size: float | Mapping[str, Any] | CacheSize, num_experts: int) -> CacheSize:
        """A size given to a stage: a resolved size (`to_dict`, what the workflow passes) or a
        bare fraction in (0, 1] (C = capacity_for(fraction, E))."""
        if isinstance(size, CacheSize):
            return size
        if isinstance(size, Mapping):
            unknown = set(size) - {"label", "capacity", "fraction", "budget"}
            if unknown or not {"label", "capacity", "fraction"} <= set(size):
                raise ValueError(
                    f"size: expected a fraction or a resolved size with keys label, capacity, "
                    f"fraction (budget), got {dict(size)!r}"
                )
            return cls(str(size["label"]), int(size["capacity"]), float(size["fraction"]),
                       size.get("budget"))  # fmt: skip
        capacity = capacity_for(size, num_experts)
        return cls(fraction_label(size), capacity, float(size))


def fraction_label(fraction: float) -> str:
    """A fraction's size label: f + its shortest decimal (0.25 -> f0.25, 1.0 -> f1)."""
    return f"f{format(float(fraction), 'g')}"


def budget_label(text: str) -> str:
    """A budget's size label: b + the text as written (10GiB -> b10GiB)."""
    return f"b{text}"


def resolve_size(
    value: float | str, num_experts: int, pricing: PricingGeometry | None, expert_bits: float
) -> CacheSize:
    """A configured size (a fraction, or a budget string) resolved for one model (`pricing`:
    needed by a budget only). Checks nothing about k or E (the config names the key when it
    checks the result)."""
    if isinstance(value, str):
        if pricing is None:
            raise ValueError(f"budget {value!r}: needs the model's pricing geometry")
        nbytes = budget_bytes(value)
        budget = {
            "budget": value,
            "budget_bytes": nbytes,
            "expert_bits": float(expert_bits),
            "expert_bytes": pricing.expert_bytes(expert_bits),
            "pricing": pricing.to_dict(),
        }
        capacity = budget_slots(nbytes, pricing, expert_bits)
        return CacheSize(budget_label(value), capacity, capacity / num_experts, budget)
    return CacheSize(fraction_label(value), capacity_for(value, num_experts), float(value))


# --------------------------------------------------------------------------------------------
# pin specs

# config-level policy keys the layout resolves (everything else is a `Policy` field)
LAYOUT_KEYS = ("pin", "allocation")
ALLOCATIONS = ("uniform", "planned")
_SHARE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)%$")
_ALL_BUT_RE = re.compile(r"^C-([0-9]+|k)$")


def check_pin_spec(spec: Any) -> int | str:
    """A pin spec: an int >= 0, a share "<p>%" with 0 <= p <= 100, or "C-k" / "C-<n>"."""
    if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0:
        return spec
    if isinstance(spec, str):
        share = _SHARE_RE.match(spec)
        if share and Fraction(share.group(1)) <= 100:
            return spec
        if _ALL_BUT_RE.match(spec):
            return spec
    raise ValueError(
        f"pin: {spec!r} is not a pin spec; expected an integer >= 0, a share of each layer's "
        'slots ("50%"), or all but n slots ("C-k" with the model\'s k, "C-2")'
    )


def pin_count(spec: int | str, capacity: int, top_k: int) -> int:
    """Pinned experts of one layer of `capacity` slots: the int, floor(share * C), or C - n."""
    spec = check_pin_spec(spec)
    if isinstance(spec, int):
        return spec
    share = _SHARE_RE.match(spec)
    if share:
        return math.floor(Fraction(share.group(1)) / 100 * capacity)
    n = _ALL_BUT_RE.match(spec).group(1)  # type: ignore[union-attr]
    return max(capacity - (top_k if n == "k" else int(n)), 0)


def layer_pin(spec: int | str, capacity: int, top_k: int, prefetch: int) -> int:
    """`pin_count` of one layer, checked to leave a token's experts their slots:
    pin_l + max(k, prefetch) <= C_l."""
    pin = pin_count(spec, capacity, top_k)
    if pin + max(top_k, prefetch) > capacity:
        raise ValueError(
            f"pin {spec!r} pins {pin} of C_l={capacity} slots, leaving fewer than max(k, "
            f"prefetch) = {max(top_k, prefetch)} for a token's experts (pin_l + max(k, "
            "prefetch) <= C_l)"
        )
    return pin


def min_layer_capacity(spec: int | str, top_k: int, prefetch: int, num_experts: int) -> int | None:
    """The smallest C_l in [k, E] whose pins leave the slots a token needs:
    pin_count + max(k, prefetch) <= C_l (None: no C_l <= E does)."""
    need = max(top_k, prefetch)
    return next(
        (c for c in range(top_k, num_experts + 1) if pin_count(spec, c, top_k) + need <= c), None
    )


def policy_fields(spec: Mapping[str, Any] | Policy) -> dict[str, Any]:
    """A config policy dict without its layout keys (`LAYOUT_KEYS`): the `Policy` fields."""
    if isinstance(spec, Policy):
        return spec.to_dict()
    return {k: v for k, v in spec.items() if k not in LAYOUT_KEYS}
