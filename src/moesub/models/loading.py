"""Loading a local checkpoint: its checks, its placement over devices, model and tokenizer.

`check_checkpoint` validates a checkpoint directory without reading its weights. `load_model`
loads it whole on one device, or placed by Accelerate (`ModelLoading`: layers over CUDA
devices, the CPU and the disk) when it does not fit one; `input_device` and `execution_device`
name where a placed model's inputs and a placed module's computations go.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moesub.config import check_checkpoint_dir, has_tokenizer, schema_defaults
from moesub.models.families import SUPPORTED_FAMILIES, MoEInfo, moe_info
from moesub.params import options_from

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


# --------------------------------------------------------------------------------------------
# checkpoint and tokenizer checks


def _load_config(p: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(p)!r}: cannot read the model config: {e}") from e


def check_checkpoint(path: str | os.PathLike, tokenizer: bool = False) -> MoEInfo:
    """Validate a local checkpoint without loading its weights and return its routing geometry.

    The model is built on the meta device from its config (no memory, no weights), so the
    answer comes from the same module-structure code as `moe_info`. `tokenizer`: the checkpoint
    must also hold tokenizer files (the pipeline tokenizes its streams with them).
    """
    from transformers import AutoModelForCausalLM

    p = check_checkpoint_dir(path, "model path")
    has_weights = any((p / f).is_file() for f in _WEIGHT_FILES) or any(p.glob("*.safetensors"))
    if not has_weights:
        raise ValueError(
            f"{str(p)!r} is not a complete checkpoint: no weight files ({', '.join(_WEIGHT_FILES)})"
        )
    has_tokenizer(p, required=tokenizer)
    config = _load_config(p)
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"{str(p)!r}: model family {family!r} is not a supported MoE family "
            f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises many kinds for a bad config
        raise ValueError(f"{str(p)!r}: cannot build the model from its config: {e}") from e
    try:
        return moe_info(model)
    except ValueError as e:
        raise ValueError(f"{str(p)!r}: {e}") from e


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of checkpoint `path`; a missing or empty one is an error that says so."""
    from transformers import AutoTokenizer

    p = Path(path)
    has_tokenizer(p, required=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(p)!r}: the tokenizer files do not load: {e}") from e
    if len(tokenizer) == 0 or not tokenizer("a b c")["input_ids"]:
        raise ValueError(f"{str(p)!r}: the tokenizer is empty (it encodes text to no tokens)")
    return tokenizer


# --------------------------------------------------------------------------------------------
# placement over devices


_LOADING_DEFAULTS = schema_defaults("models.*.loading")  # workflow/schemas/config.schema.yaml
# Accelerate's placement strategies for `device_map` (a dict places modules explicitly).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _accelerate_device(value: Any, what: str) -> int | str:
    """A device of a device map / memory budget as Accelerate names it: "cpu", "disk", or the
    CUDA index (int) for "cuda:N" / N; a CUDA device this machine lacks is an error."""
    if isinstance(value, str) and value in ("cpu", "disk"):
        return value
    text = str(value)
    index = text.removeprefix("cuda:") if text.startswith("cuda:") else text
    if isinstance(value, bool) or not index.isdigit():
        raise ValueError(f"{what}: {value!r} is not a device (cpu, disk, cuda:N or N)")
    if int(index) >= torch.cuda.device_count():
        raise ValueError(
            f"{what}: {value!r} names CUDA device {index}, but this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return int(index)


@dataclass(frozen=True)
class ModelLoading:
    """How a checkpoint's weights are placed when it does not fit one device (config
    `models.<name>.loading`, passed to transformers' `from_pretrained` and so to Accelerate).

    `device_map`: None loads the whole model on the stage's `device`; a strategy
    (DEVICE_MAP_STRATEGIES) lets Accelerate place decoder layers over the CUDA devices, the
    CPU and the disk within `max_memory`; a dict maps module names ("model.layers.3") to a
    device ("cuda:0", "cpu", "disk"). Accelerate's hooks then move each layer's activations to
    its device and load disk-offloaded weights for the layer's forward. `max_memory`: device
    -> budget ("70GiB", bytes) for a strategy. `offload_folder`: where disk-offloaded weights
    that cannot be read from the checkpoint itself are written (MoE experts, which
    transformers fuses at load); each load writes into its own fresh subdirectory, removed
    with the model (None: the system temp dir, which may be RAM-backed).
    """

    device_map: str | dict[str, Any] | None = _LOADING_DEFAULTS["device_map"]
    max_memory: dict[str, Any] | None = _LOADING_DEFAULTS["max_memory"]
    offload_folder: str | None = _LOADING_DEFAULTS["offload_folder"]

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | ModelLoading | None) -> ModelLoading:
        if isinstance(params, ModelLoading):
            return params
        p = options_from(cls, params, "model loading")
        p.accelerate_kwargs()  # every check, before any weight is read
        return p

    @property
    def dispatched(self) -> bool:
        """Whether Accelerate places the model (else it is loaded whole on one device)."""
        return self.device_map is not None

    def accelerate_kwargs(self) -> dict[str, Any]:
        """`device_map` and `max_memory` for `from_pretrained`, in Accelerate's device names
        (checked: errors name the `loading.` key)."""
        if not self.dispatched:
            for key in ("max_memory", "offload_folder"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"loading.{key} is set but loading.device_map is null: a memory "
                        "budget or offload folder needs a device_map (e.g. 'auto')"
                    )
            return {}
        from accelerate.utils import convert_file_size_to_int

        dm = self.device_map
        if isinstance(dm, str):
            if dm not in DEVICE_MAP_STRATEGIES:
                raise ValueError(
                    f"loading.device_map: {dm!r} is not one of {list(DEVICE_MAP_STRATEGIES)} "
                    "or a {module: device} mapping"
                )
        elif isinstance(dm, Mapping) and dm:
            dm = {
                str(name): _accelerate_device(dev, f"loading.device_map[{name!r}]")
                for name, dev in dm.items()
            }
        else:
            raise ValueError(
                f"loading.device_map: expected null, a strategy {list(DEVICE_MAP_STRATEGIES)} "
                f"or a non-empty {{module: device}} mapping, got {dm!r}"
            )
        out: dict[str, Any] = {"device_map": dm}
        if self.max_memory is not None:
            if not isinstance(self.max_memory, Mapping) or not self.max_memory:
                raise ValueError(
                    f"loading.max_memory: expected a {{device: size}} mapping, got "
                    f"{self.max_memory!r}"
                )
            if not isinstance(dm, str):
                raise ValueError(
                    "loading.max_memory: a budget is for a device_map strategy "
                    f"({list(DEVICE_MAP_STRATEGIES)}); an explicit device_map places every "
                    "module itself"
                )
            budget = {}
            for dev, size in self.max_memory.items():
                key = _accelerate_device(dev, f"loading.max_memory key {dev!r}")
                try:
                    budget[key] = convert_file_size_to_int(size)
                except (ValueError, TypeError) as e:
                    raise ValueError(
                        f"loading.max_memory[{dev!r}]: {size!r} is not a size (bytes, or a "
                        "string such as '70GiB' or '500MB')"
                    ) from e
            out["max_memory"] = budget
        return out


def execution_device(module: nn.Module, fallback: torch.device) -> torch.device:
    """Where `module` computes: Accelerate's execution device when it placed the module, else
    its first parameter's device (`fallback` for a module without parameters or with its
    weights on the meta device, offloaded)."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    param = next(module.parameters(), None)
    if param is None or param.device.type == "meta":
        return fallback
    return param.device


def input_device(model: nn.Module) -> torch.device:
    """The device a forward's input ids go to: the input embedding's execution device when
    Accelerate placed the model (its weight may sit on the meta device, offloaded), else the
    embedding weight's device."""
    embed = model.get_input_embeddings()
    return execution_device(embed, embed.weight.device)


# --------------------------------------------------------------------------------------------
# loading


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    loading: Mapping[str, Any] | ModelLoading | None = None,
) -> tuple[nn.Module, Any]:
    """Load a local MoE checkpoint (eval mode) and its tokenizer (None if the dir has none).

    `loading` (ModelLoading): with a device_map the model is placed by Accelerate (layers on
    CUDA devices, the CPU or the disk) and `device` is not used; `input_device` names where
    its inputs go."""
    from transformers import AutoModelForCausalLM

    loading = ModelLoading.from_dict(loading)
    check_checkpoint(path)
    p = Path(path)
    if loading.dispatched:
        offload = Path(
            tempfile.mkdtemp(prefix="moesub-offload-", dir=_offload_parent(loading.offload_folder))
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                p,
                dtype=dtype,
                local_files_only=True,
                offload_folder=str(offload),
                **loading.accelerate_kwargs(),
            ).eval()
        except BaseException:
            shutil.rmtree(offload, ignore_errors=True)
            raise
        # Offloaded weights are read from the folder at every forward: it lives with the model.
        weakref.finalize(model, shutil.rmtree, str(offload), ignore_errors=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
        model = model.to(device).eval()
    _realign(model)
    tokenizer = load_tokenizer(p) if has_tokenizer(p) else None
    return model, tokenizer


def _offload_parent(folder: str | None) -> str | None:
    if folder is None:
        return None
    parent = Path(folder)
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"loading.offload_folder: {folder!r} is a file; give a directory")
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _realign(model: nn.Module, alignment: int = 64) -> None:
    """Copy CPU tensors that are not `alignment`-byte aligned into fresh (aligned) memory.

    Weights loaded from safetensors on CPU are views into the memory-mapped file at 8-byte
    offsets, and MKL's float32 GEMM rounds differently depending on operand alignment (measured:
    last-bit differences in router logits between a loaded model and the same weights in
    fresh memory). Fresh allocations make results independent of how the weights arrived.
    """
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type == "cpu" and t.data_ptr() % alignment:
                t.data = t.data.clone(memory_format=torch.contiguous_format)
