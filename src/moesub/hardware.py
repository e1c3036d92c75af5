"""Hardware profiles: a machine's bandwidths and fixed costs, priced for a model's bytes.

A `HardwareProfile` holds what belongs to the machine: the link from the slow tier to the fast
tier, the rate at which the fast tier streams expert weights at batch 1, the host's memory and
cores, fixed costs per layer and per token, and whether the host computes its experts
concurrently with the fast tier (`concurrent_host`: a host processor separate from the fast
tier, as on a GPU machine). What a token reads belongs to the model (`ModelBytes`: one expert's
bytes at the storage precision, the non-expert bytes of a layer, the head). `profile.price(model)`
turns the two into the seconds of each event the pricing counts (`UnitCosts`, read by
`moesub.pricing`): one copy, one expert on the fast tier, one on the host, a layer's dense work,
a token's fixed part, one background copy installed.

Shipped profiles (`PROFILES`) are estimates from spec sheets and published measurements;
`this_machine(path)` is the engine's calibration on the running machine (measured). Every
constant's source and derivation: docs/hardware.md. No torch, no compiled core here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from moesub.slots import REFERENCE_GEOMETRY

SOURCES = ("estimate", "measured")  # a profile from spec sheets, or from a calibration run
# what the pricing is held to: a policy's price within this share of the engine's measured time
PRICE_HELD_TO = 0.10
# a timed run is "contended" (its times slower than the machine's: `moesub.engine.contention`)
# below this CPU share, or beside more cores than this kept busy by others: runs alone had
# 0.00-0.05, and the runs beside 0.18-0.22 cores of other load were 17-52% slower (2026-12-04)
CONTENDED_BELOW = 0.8
SHARED_ABOVE = 0.1


def is_contended(cpu_share: float, other_cores: float) -> bool:
    """The `contended` flag of a timed run; `other_cores` NaN (not measured): the share alone."""
    return bool(cpu_share < CONTENDED_BELOW or other_cores > SHARED_ABOVE)


@dataclass(frozen=True)
class ModelBytes:
    """What one decode step reads, per kind: the model side of the pricing."""

    expert_bytes: float  # one routed expert at the storage precision
    dense_bytes_per_layer: float = 0.0  # non-expert weights read per MoE layer (attention, router,
    # shared expert, norms)
    head_bytes: float = 0.0  # read once per token outside the layers (the LM head)

    def __post_init__(self) -> None:
        if not self.expert_bytes > 0:
            raise ValueError(f"ModelBytes: expert_bytes={self.expert_bytes} must be > 0")
        for name in ("dense_bytes_per_layer", "head_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ModelBytes: {name}={getattr(self, name)} must be >= 0")


# Qwen3-Next-80B-A3B (the reference model; counted from transformers' Qwen3NextConfig defaults,
# which are that model's, on the meta device: docs/hardware.md): its experts are
# `moesub.slots.REFERENCE_GEOMETRY` (48 MoE layers of 512, hidden 2048, expert width 512); the
# 36 linear-attention layers hold 37,918,912 non-expert weights each and the 12 full-attention
# layers 31,463,936 (router, shared expert and its gate, norms included); the LM head is
# 151,936 x 2048.
REFERENCE_DENSE_WEIGHTS_PER_LAYER = (36 * 37_918_912 + 12 * 31_463_936) / 48
REFERENCE_HEAD_WEIGHTS = 151_936 * 2048


def reference_model_bytes(expert_bits: float = 16.0, dense_bits: float = 16.0) -> ModelBytes:
    """The reference model's bytes: experts at `expert_bits`, everything else at `dense_bits`
    (runtimes keep attention and the head at higher precision than the experts)."""
    return ModelBytes(
        expert_bytes=REFERENCE_GEOMETRY.expert_bytes(expert_bits),
        dense_bytes_per_layer=REFERENCE_DENSE_WEIGHTS_PER_LAYER * dense_bits / 8,
        head_bytes=REFERENCE_HEAD_WEIGHTS * dense_bits / 8,
    )


_FLAGS = ("concurrent_host", "host_reads_link")  # the boolean keys of a profile and its costs


@dataclass(frozen=True)
class UnitCosts:
    """Seconds of each event the pricing counts: a hardware profile priced for a model."""

    copy_s: float  # one expert over the link (synchronous or background)
    expert_s: float  # one expert computed on the fast tier for one token
    host_expert_s: float  # one expert computed by the host for one token
    dense_layer_s: float  # a MoE layer's work besides its routed experts and copies
    token_overhead_s: float  # a token's fixed part (the LM head, starting and ending the step)
    install_s: float  # fast-tier work to install one landed background copy
    concurrent_host: bool  # host experts run while the fast tier works (else one after another)
    host_reads_link: bool = False  # the host's experts come over the link (a disk tier)
    # the fractions by which the fast tier's work slows while the host reads over the link (one
    # processor that reads and computes: the disk tier): the host's reads of the experts it
    # computes, and the background copies; 0 on a GPU machine
    host_read_drag: float = 0.0
    background_read_drag: float = 0.0
    # a step that copies synchronously, once: issuing its copies and resuming after the wait,
    # beyond each copy's `copy_s` (the disk tier's main thread: measured)
    sync_step_s: float = 0.0
    # one of the host's reads over the link (`host_reads_link`); None: a copy's `copy_s`. The
    # host reads a step's experts back to back, and on the disk tier faster each than the
    # copies come (measured: docs/pricing.md)
    host_read_s: float | None = None
    # a step that computes experts on the host, once: handing them to the host and taking its
    # results back (the disk tier's worker: measured)
    host_step_s: float = 0.0
    # a batch of background copies (a step's requests, a layer's prefetches) queued while none
    # is still on the link, once: starting the idle background lane (the disk tier's I/O
    # thread: measured)
    background_start_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _FLAGS or (f.name == "host_read_s" and v is None):
                continue
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"UnitCosts: {f.name}={v} must be finite and >= 0")

    @property
    def host_read_each_s(self) -> float:
        """One of the host's reads over the link: `host_read_s`, or a copy's where None."""
        return self.copy_s if self.host_read_s is None else self.host_read_s


@dataclass(frozen=True)
class HardwareProfile:
    """A machine as the pricing sees it (keys of a user's `hardware:` profile: the fields).

    Rates are effective bytes per second at batch 1; a per-expert time is the expert's bytes
    over the rate that serves it. The host's rate is its memory's, capped by what `host_cores`
    cores reading `host_core_Bps` each can draw. `dense_layer_s` given (a measurement): the dense
    work of a layer and the head (amortized over layers) as that constant; left out: the model's
    dense bytes per layer and head bytes over `fast_memory_Bps`."""

    name: str
    description: str
    source: str  # "estimate" (spec sheets, docs/hardware.md) or "measured" (a calibration)
    concurrent_host: bool  # a host processor separate from the fast tier
    link_bandwidth_Bps: float  # slow tier -> fast tier, practical
    transfer_latency_s: float  # fixed cost of one copy
    fast_memory_Bps: float  # the fast tier's expert kernels stream weights at this rate
    host_memory_Bps: float  # host memory read rate, all channels
    host_cores: int | None = None  # cores computing host experts (None: memory-bound only)
    host_core_Bps: float | None = None  # read rate one core sustains
    dense_layer_s: float | None = None  # measured dense work per MoE layer (None: from bytes)
    layer_overhead_s: float = 0.0  # per MoE layer: router to the host, policy step, launches
    token_overhead_s: float = 0.0  # per token besides the head
    install_Bps: float | None = None  # device-to-device copy rate (None: fast_memory_Bps / 2,
    # a copy reads and writes every byte)
    # the host reads the experts it computes over the link, as the copies do (a disk tier whose
    # host computes from a fresh read); on a GPU machine it reads them from its own memory
    host_reads_link: bool = False
    # the fractions by which the fast tier's work slows while the host reads over the link (a
    # disk tier, measured: `moesub.engine.microbench.measure_read_drags`): the host's reads of the
    # experts it computes, and the background copies; a GPU computes undisturbed beside its DMA
    host_read_drag: float = 0.0
    background_read_drag: float = 0.0
    # seconds a step that copies synchronously takes once, beyond its copies: issuing them and
    # resuming after the wait (measured on the disk tier; the GPU estimates leave it at 0)
    sync_step_s: float = 0.0
    # the rate of the host's reads over the link (`host_reads_link`), which come back to back
    # (None: `link_bandwidth_Bps`; measured on the disk tier)
    host_read_Bps: float | None = None
    # seconds a step that computes experts on the host takes once, beyond its experts: handing
    # them to the host and taking its results back (measured on the disk tier; the GPU
    # estimates leave it at 0)
    host_step_s: float = 0.0
    # seconds a batch of background copies costs the fast tier once where none is still on the
    # link: starting the idle background lane (measured on the disk tier, whose I/O thread a
    # request wakes; the GPU estimates leave it at 0)
    background_start_s: float = 0.0

    def __post_init__(self) -> None:
        where = f"hardware.{self.name}"
        if self.source not in SOURCES:
            raise ValueError(f"{where}.source={self.source!r} must be one of {list(SOURCES)}")
        for key in _FLAGS:
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{where}.{key}={getattr(self, key)!r} must be a bool")
        for key in ("link_bandwidth_Bps", "fast_memory_Bps", "host_memory_Bps"):
            _check_number(where, key, getattr(self, key), positive=True, infinite=True)
        for key in ("transfer_latency_s", "layer_overhead_s", "token_overhead_s",
                    "host_read_drag", "background_read_drag", "sync_step_s",
                    "host_step_s", "background_start_s"):  # fmt: skip
            _check_number(where, key, getattr(self, key))
        for key in ("host_core_Bps", "install_Bps", "host_read_Bps"):
            if getattr(self, key) is not None:
                _check_number(where, key, getattr(self, key), positive=True, infinite=True)
        if self.dense_layer_s is not None:
            _check_number(where, "dense_layer_s", self.dense_layer_s)
        if (self.host_cores is None) != (self.host_core_Bps is None):
            raise ValueError(f"{where}: give host_cores and host_core_Bps together, or neither")
        if self.host_cores is not None and (
            isinstance(self.host_cores, bool)
            or not isinstance(self.host_cores, int)
            or self.host_cores < 1
        ):
            raise ValueError(f"{where}.host_cores={self.host_cores!r} must be an integer >= 1")

    @property
    def host_Bps(self) -> float:
        """The rate the host computes its experts at: memory-bound, capped by its cores."""
        if self.host_cores is None:
            return self.host_memory_Bps
        return min(self.host_memory_Bps, self.host_cores * self.host_core_Bps)

    def price(self, model: ModelBytes) -> UnitCosts:
        """The seconds of each counted event for a model's bytes (docs/hardware.md)."""
        b = model.expert_bytes
        if self.dense_layer_s is None:
            dense = model.dense_bytes_per_layer / self.fast_memory_Bps
            head = model.head_bytes / self.fast_memory_Bps
        else:  # measured on the model itself: the head is amortized in it
            dense, head = self.dense_layer_s, 0.0
        install = self.install_Bps if self.install_Bps is not None else self.fast_memory_Bps / 2
        host_read = None  # as a copy
        if self.host_read_Bps is not None:
            host_read = self.transfer_latency_s + b / self.host_read_Bps
        return UnitCosts(
            copy_s=self.transfer_latency_s + b / self.link_bandwidth_Bps,
            expert_s=b / self.fast_memory_Bps,
            host_expert_s=b / self.host_Bps,
            dense_layer_s=dense + self.layer_overhead_s,
            token_overhead_s=head + self.token_overhead_s,
            install_s=b / install,
            concurrent_host=self.concurrent_host,
            host_reads_link=self.host_reads_link,
            host_read_drag=self.host_read_drag,
            background_read_drag=self.background_read_drag,
            sync_step_s=self.sync_step_s,
            host_step_s=self.host_step_s,
            background_start_s=self.background_start_s,
            host_read_s=host_read,
        )

    def to_dict(self) -> dict[str, Any]:
        """The profile's keys (`from_dict`'s mapping; the name is the key it is filed under)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> HardwareProfile:
        """A profile from a mapping of this class's fields (a `hardware:` entry in config.yaml):
        `name` comes from the key; unknown, missing or ill-typed keys are errors naming them."""
        where = f"hardware.{name}"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping of profile keys, got {data!r}")
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
        required = {
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        } - {"name"}
        absent = sorted(required - set(data))
        if absent:
            raise ValueError(f"{where}: missing key(s) {absent}")
        for key, value in data.items():
            if key in ("description", "source") and not isinstance(value, str):
                raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
        return cls(name=name, **data)  # its checks name `hardware.<name>.<key>`


def _check_number(
    where: str, key: str, value: Any, positive: bool = False, infinite: bool = False
) -> None:
    """A real number >= 0 (> 0 with `positive`; inf allowed with `infinite`), else an error."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (infinite or math.isfinite(value)) and (value > 0 if positive else value >= 0)
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{where}.{key}={value!r} must be a number {bound}")


THIS_MACHINE = "this_machine"  # the profile measured on the running machine (reserved name)
UNIT_COST_KEYS = tuple(f.name for f in fields(UnitCosts) if f.name not in _FLAGS)


def measured_profile(
    seconds: Mapping[str, float],
    expert_bytes: float,
    description: str,
    host_reads_link: bool = False,
) -> HardwareProfile:
    """`this_machine` from measured seconds of each event (`UNIT_COST_KEYS`, for experts of
    `expert_bytes`): per-expert times become rates (priced for other expert sizes they scale with
    the bytes; a term measured as 0 s stays free), the dense layer and the token's fixed part stay
    constants. A copy's whole time is one rate (`transfer_latency_s` 0: one expert size cannot
    split it). One processor: host experts follow the fast tier's (`concurrent_host=False`);
    `host_reads_link` where the calibrated tier's host reads its experts over the link, and the
    measured `host_read_drag` and `background_read_drag` (fractions) and `sync_step_s`,
    `host_step_s` and `background_start_s` (constants: a step's, whatever its experts' size),
    kept as they are; the host's reads at their own rate (`host_read_s`). Priced for
    `ModelBytes(expert_bytes)` it gives the seconds back."""
    missing = [k for k in UNIT_COST_KEYS if k not in seconds]
    if missing:
        raise ValueError(f"measured profile: missing unit cost(s) {missing}")
    where = f"hardware.{THIS_MACHINE}"
    for key in UNIT_COST_KEYS:
        _check_number(where, key, seconds[key])
    _check_number(where, "expert_bytes", expert_bytes, positive=True)

    def rate(key: str) -> float:  # bytes per second of a per-expert time (0 s: free)
        return expert_bytes / seconds[key] if seconds[key] > 0 else math.inf

    return HardwareProfile(
        name=THIS_MACHINE,
        description=description,
        source="measured",
        concurrent_host=False,
        link_bandwidth_Bps=rate("copy_s"),
        transfer_latency_s=0.0,
        fast_memory_Bps=rate("expert_s"),
        host_memory_Bps=rate("host_expert_s"),
        dense_layer_s=seconds["dense_layer_s"],
        token_overhead_s=seconds["token_overhead_s"],
        install_Bps=rate("install_s"),
        host_reads_link=host_reads_link,
        host_read_drag=seconds["host_read_drag"],
        background_read_drag=seconds["background_read_drag"],
        sync_step_s=seconds["sync_step_s"],
        host_step_s=seconds["host_step_s"],
        background_start_s=seconds["background_start_s"],
        host_read_Bps=rate("host_read_s"),
    )


def this_machine(calibration: str | os.PathLike | Mapping[str, Any]) -> HardwareProfile:
    """The running machine's profile from the engine's calibration (`results/{model}/engine/
    {device}/calibration.json`, or its dict: its `profile`, `moesub.engine.calibrate`)."""
    if isinstance(calibration, Mapping):
        cal, where = dict(calibration), "calibration"
    else:
        cal, where = json.loads(Path(calibration).read_text()), str(calibration)
    if not isinstance(cal.get("profile"), Mapping):
        raise ValueError(f"{where}: no `profile` (an engine calibration's fitted profile)")
    try:
        return HardwareProfile.from_dict(THIS_MACHINE, cal["profile"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


# GPU machines, estimated from spec sheets and published measurements (every figure's source
# and derivation: docs/hardware.md). The fast tier streams weights at 70% of its memory's spec
# bandwidth at batch 1 (an assumption); PCIe 4.0 x16 carries 25 GB/s in practice (measured by
# others), PCIe 5.0 x16 an assumed 50 GB/s; desktop hosts are memory-bound, the server's 32
# cores bound it below its 12 channels.
GPU_EFFICIENCY = 0.7
_GPU = {"source": "estimate", "concurrent_host": True, "transfer_latency_s": 10e-6,
        "layer_overhead_s": 30e-6}  # fmt: skip
SHIPPED: dict[str, dict[str, Any]] = {
    "rtx3090_pcie4_ddr4": {
        **_GPU,
        "description": "the study's machine: RTX 3090 (24 GB GDDR6X) on PCIe 4.0 x16, desktop "
        "with dual-channel DDR4-3200 and 8 cores",
        "link_bandwidth_Bps": 25e9,
        "fast_memory_Bps": GPU_EFFICIENCY * 936e9,
        "host_memory_Bps": 0.8 * 51.2e9,
        "host_cores": 8,
        "host_core_Bps": 15e9,
    },
    "rtx4090_pcie4_ddr5": {
        **_GPU,
        "description": "RTX 4090 (24 GB GDDR6X) on PCIe 4.0 x16, desktop with dual-channel "
        "DDR5-6000 and 16 cores",
        "link_bandwidth_Bps": 25e9,
        "fast_memory_Bps": GPU_EFFICIENCY * 1008e9,
        "host_memory_Bps": 62e9,
        "host_cores": 16,
        "host_core_Bps": 15e9,
    },
    "rtx5090_pcie5_ddr5": {
        **_GPU,
        "description": "RTX 5090 (32 GB GDDR7) on PCIe 5.0 x16, desktop with dual-channel "
        "DDR5-6000 and 16 cores",
        "link_bandwidth_Bps": 50e9,
        "fast_memory_Bps": GPU_EFFICIENCY * 1792e9,
        "host_memory_Bps": 62e9,
        "host_cores": 16,
        "host_core_Bps": 15e9,
    },
    "h100_pcie5_server": {
        **_GPU,
        "description": "H100 PCIe (80 GB HBM2e) on PCIe 5.0 x16, server with 12-channel "
        "DDR5-4800 and 32 cores for the host's experts",
        "link_bandwidth_Bps": 50e9,
        "fast_memory_Bps": GPU_EFFICIENCY * 2000e9,
        "host_memory_Bps": 0.8 * 460.8e9,
        "host_cores": 32,
        "host_core_Bps": 10e9,
    },
}
PROFILES: dict[str, HardwareProfile] = {
    name: HardwareProfile.from_dict(name, spec) for name, spec in SHIPPED.items()
}
STUDY_PROFILE = "rtx3090_pcie4_ddr4"


def read_unit_costs(path: str | os.PathLike) -> tuple[str, UnitCosts]:
    """(profile name, its seconds) from a profile priced for a model (`moesub.price.
    write_profile`'s JSON: `results/{model}/hardware/{hardware}.json`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"hardware profile {str(path)!r} does not exist")
    doc = json.loads(path.read_text())
    return doc["name"], UnitCosts(**doc["unit_costs"])
