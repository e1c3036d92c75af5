"""An engine's checked inputs: the `engine:` options (`EngineParams`) and everything one engine
run is built from (`EngineSpec`, by `resolve_engine`), checked before any model is loaded."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from moesub.config import schema_defaults
from moesub.engine.runtime import ADMISSION_TIMINGS
from moesub.engine.tiers import require_cuda
from moesub.io import require_file
from moesub.params import options_from
from moesub.policy import ALL_RESIDENT, ALL_RESIDENT_POLICY, Policy
from moesub.slots import CacheSize

_DEFAULTS = schema_defaults("engine")  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class EngineParams:
    """The `engine:` section of config.yaml (every key optional)."""

    # model and expert dtype (None: bfloat16 on CUDA, float32 on the CPU, see `engine_dtype`)
    dtype: str | None = _DEFAULTS["dtype"]
    store_path: str | None = None  # expert file of the disk tier (default: beside the model)
    # background admissions in flight at most (None: 4 on the disk tier; on CUDA one per slot
    # of every layer within 512 MiB of GPU memory, `cuda_tier.default_staging_buffers`)
    staging_buffers: int | None = _DEFAULTS["staging_buffers"]
    # CUDA tier: GiB of pinned host memory for experts; the layers past it stay in the expert
    # store on disk (disk -> pinned RAM -> GPU). None: every layer pinned
    pinned_budget_gb: float | None = _DEFAULTS["pinned_budget_gb"]
    # decode only the first n streams (smoke runs)
    max_streams: int | None = _DEFAULTS["max_streams"]
    # decode only the first n tokens of each stream
    max_tokens: int | None = _DEFAULTS["max_tokens"]
    threads: int | None = None  # torch CPU threads (None = torch's default)
    progress: bool = True
    # the calibration (`moesub.engine.calibrate`): tokens of each of the `calibrate_streams`
    # calibration streams a run decodes (the next ones in turn), in `calibrate_rounds` rounds
    calibrate_tokens: int = _DEFAULTS["calibrate_tokens"]
    calibrate_streams: int = _DEFAULTS["calibrate_streams"]
    calibrate_rounds: int = _DEFAULTS["calibrate_rounds"]
    # background admissions usable when their copy completes ("completion"), or exactly
    # policy.delay tokens after the request, waiting for the copy if needed ("delay": the
    # emulator's and simulator's decisions, token for token)
    admission: str = "completion"

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> EngineParams:
        p = options_from(cls, params, "engine", section="engine")
        # the library-only options (not config keys)
        if p.admission not in ADMISSION_TIMINGS:
            raise ValueError(f"params.admission={p.admission!r} not in {list(ADMISSION_TIMINGS)}")
        v = p.threads
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"params.threads={v!r} must be a positive integer")
        return p


def engine_dtype(opts: EngineParams, device: torch.device) -> str:
    """The engine's dtype: `opts.dtype`, else bfloat16 on CUDA (the checkpoints' own dtype, half
    the bytes per copy) and float32 on the CPU (the capture's dtype: NLL comparable)."""
    if opts.dtype is not None:
        return opts.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


@dataclass(frozen=True)
class EngineSpec:
    """Checked inputs of one engine (`resolve_engine`): nothing loaded yet."""

    name: str
    policy: Policy
    policy_meta: dict[str, Any]  # the policy as given (artefact metadata)
    size: CacheSize  # the cache size (C = E for all_resident)
    # the resident set every stream / prompt starts from: int32 (L, C), or L 1-D arrays of
    # lengths C_l (a planned layout: per-layer slot counts, sum C_l = L x C)
    initial: np.ndarray | tuple[np.ndarray, ...]
    device: torch.device
    opts: EngineParams
    info: Any  # moesub.models.MoEInfo
    layout: dict[str, Any] | None = None  # the layout's metadata (None: no ranking given)

    @property
    def fraction(self) -> float:
        return self.size.fraction

    @property
    def capacity(self) -> int:
        return self.size.capacity

    @property
    def slots(self) -> int | tuple[int, ...]:
        """The tier's slots: C for every layer, or C_l per layer (a planned layout)."""
        if isinstance(self.initial, np.ndarray):
            return self.size.capacity
        return tuple(len(layer) for layer in self.initial)


def resolve_engine(
    model_dir: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any] | Policy | None,
    size: float | Mapping[str, Any],
    device: str,
    params: Mapping[str, Any] | None = None,
    initial: np.ndarray | None = None,
    ranking_path: str | os.PathLike | None = None,
    allocation_path: str | os.PathLike | None = None,
) -> EngineSpec:
    """Check an engine's inputs without loading the model: the policy (ignored for
    `all_resident`), the cache size (a resolved size or a fraction) against the checkpoint's E
    and k, the engine options, the device, and the initial resident set: the layout from the
    expert ranking at `ranking_path` (`moesub.artefacts.layout_for`: the policy's pins), else
    `initial` (L, C), or experts 0..C-1 when both are None (as `moesub.emulate`). A layout
    with per-layer capacities (`allocation: planned`, from `allocation_path`) gives the tier
    C_l slots at layer l and `initial` as L arrays."""
    from moesub.artefacts import layout_for
    from moesub.models import check_checkpoint
    from moesub.policy import check_capacity, check_initial
    from moesub.replay import check_run, policy_from_dict

    require_file(model_dir, "model_dir")
    check_run(name, size)
    all_resident = name == ALL_RESIDENT
    opts = EngineParams.from_dict(params)
    dev = require_cuda(device)
    opts = replace(opts, dtype=engine_dtype(opts, dev))
    info = check_checkpoint(model_dir)
    E, k, L = info.num_experts, info.top_k, info.num_layers
    layout = None
    if all_resident:
        pol = ALL_RESIDENT_POLICY
        size = CacheSize(ALL_RESIDENT, E, 1.0)
        initial = np.tile(np.arange(E, dtype=np.int32), (L, 1))
    elif ranking_path is not None:
        require_file(ranking_path, "ranking_path")
        spec = policy.to_dict() if isinstance(policy, Policy) else dict(policy or {})
        built = layout_for(ranking_path, size, spec, k, L, E, allocation_path)
        pol = policy_from_dict(built.policy(spec))
        initial = built.initial_array() if built.uniform else tuple(built.initial)
        size, layout = built.size, built.to_dict()
    else:
        pol = policy_from_dict(policy)
        size = CacheSize.of(size, E)
        check_capacity(size.fraction, E, k)
        initial = check_initial(initial, (L, size.capacity), E)
        if initial is None:
            initial = np.tile(np.arange(size.capacity, dtype=np.int32), (L, 1))
    meta = pol.to_dict() if all_resident or isinstance(policy, Policy) else dict(policy)
    return EngineSpec(name, pol, meta, size, initial, dev, opts, info, layout)
