"""The `hardware:` section: which hardware profiles are priced, and the user's own profiles.

`hardware.price` lists the profiles priced (null: `this_machine`, every shipped estimate and
every profile defined in the section); every other key of the section defines a profile
(`moesub.hardware.HardwareProfile.from_dict`, errors naming `hardware.<name>.<key>`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moesub.hardware import (
    SHIPPED,
    THIS_MACHINE,
    HardwareProfile,
    ModelBytes,
    expert_bytes,
    reference_model_bytes,
)

SECTION_KEYS = ("price",)  # the section's own keys; every other key is a profile
PRICING_BITS = 16  # experts and dense weights priced in bf16 on the profiles


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
    """The bytes model `model` is priced at on the profiles (`ModelBytes` keys, bf16): the
    embedded model at the reference model's (Qwen3-Next-80B-A3B, whose routing geometry it
    copies); a checkpoint at its own expert shape (hidden x moe_intermediate_size x 3) and LM
    head (vocab x hidden), its non-expert layer weights not counted (priced as free)."""
    spec = config["models"][model]
    if spec.get("embedded"):
        return asdict(reference_model_bytes(PRICING_BITS))
    cfg = json.loads((Path(spec["path"]) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hidden = int(cfg["hidden_size"])
    width = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    return asdict(
        ModelBytes(
            expert_bytes=expert_bytes(hidden, width, PRICING_BITS),
            head_bytes=int(cfg["vocab_size"]) * hidden * PRICING_BITS / 8,
        )
    )
