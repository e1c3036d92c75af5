"""The `hardware:` section: which hardware profiles are priced, and the user's own profiles.

`hardware.price` lists the profiles priced (null: `this_machine`, every shipped estimate and
every profile defined in the section); every other key of the section defines a profile
(`moesub.hardware.HardwareProfile.from_dict`, errors naming `hardware.<name>.<key>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from moesub.config.geometry import read_head_weights, read_pricing_geometry
from moesub.config.sizes import expert_bits
from moesub.hardware import (
    SHIPPED,
    THIS_MACHINE,
    HardwareProfile,
    ModelBytes,
    reference_model_bytes,
)

SECTION_KEYS = ("price",)  # the section's own keys; every other key is a profile
DENSE_BITS = 16  # non-expert weights priced in bf16 (runtimes keep them above the experts')


def user_profiles(config: Mapping[str, Any]) -> dict[str, HardwareProfile]:
    """The profiles defined in `hardware:` (checked; a shipped or reserved name is an error)."""
    section = config.get("hardware") or {}
    out = {}
    for name, spec in section.items():
        if name in SECTION_KEYS:
            continue
        if name == THIS_MACHINE or name in SHIPPED:
            what = "the engine's calibration" if name == THIS_MACHINE else "a shipped profile"
            raise ValueError(
                f"config key hardware.{name}: {name!r} is {what}; give your profile another name"
            )
        out[name] = HardwareProfile.from_dict(name, spec)
    return out


def priced_hardware(config: Mapping[str, Any]) -> list[str]:
    """The names of the profiles priced, in order (`hardware.price`, or every one known)."""
    known = [THIS_MACHINE, *SHIPPED, *user_profiles(config)]
    price = (config.get("hardware") or {}).get("price")
    if price is None:
        return known
    for i, name in enumerate(price):
        if name not in known:
            raise ValueError(
                f"config key hardware.price[{i}]: unknown profile {name!r}\n"
                f"  allowed: {', '.join(known)} (or define it under hardware:)"
            )
    return list(price)


def profile_spec(config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """A priced profile's keys (`HardwareProfile.from_dict`'s mapping), None for this_machine
    (the engine's calibration gives it)."""
    if name == THIS_MACHINE:
        return None
    if name in SHIPPED:
        return dict(SHIPPED[name])
    return dict(config["hardware"][name])


def pricing_bytes(config: Mapping[str, Any], model: str) -> dict[str, float]:
    """The bytes model `model` is priced at on the profiles (`ModelBytes` keys): one expert at
    the model's pricing geometry and `expert_bits` (what its budgets buy slots with,
    `moesub.config.sizes`); the embedded model's and a trace model's dense layers and head at the
    reference model's (the embedded model copies its routing geometry; a trace records routing
    only, so it is priced as the reference model, `moesub.config.pricing_geometry`), a
    checkpoint's LM head (vocab x hidden), both in bf16. A checkpoint's other non-expert weights
    (attention, routers, shared experts) need its model built from its config, which takes
    torch: its check counts them once, and its profiles' jobs read that record
    (`moesub.price.write_profile`)."""
    bits = expert_bits(config, model)
    spec = config["models"][model]
    if spec.get("embedded") or spec.get("trace"):
        return asdict(reference_model_bytes(bits, DENSE_BITS))
    where = f"models.{model}.path"
    return asdict(
        ModelBytes(
            expert_bytes=read_pricing_geometry(spec["path"], where).expert_bytes(bits),
            head_bytes=read_head_weights(spec["path"], where) * DENSE_BITS / 8,
        )
    )
