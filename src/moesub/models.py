"""Adapters for transformers' sparse-MoE causal LMs: structure, loading, router hook, exact NLL.

Supported families (transformers 5 module layout, measured on 5.24): Qwen3-Next, Qwen3-MoE,
Qwen2-MoE, OLMoE, FlexOlmo and Mixtral. In all of them decoder layer `i` is
`model.model.layers[i]`, its MLP is `layer.mlp`, and an MoE layer's MLP is a sparse block with

- `block.gate`: a TopKRouter with `weight [E, H]`, `top_k`, `num_experts` whose forward maps
  hidden states `[N, H]` to `(router_logits [N, E], weights [N, k], ids [N, k])`: softmax in
  float32, top-k of the probabilities (descending), renormalized over the k when
  `norm_topk_prob` (always for Mixtral);
- `block.experts`: fused 3-D parameters `gate_up_proj [E, 2I, H]` (gate half first) and
  `down_proj [E, H, I]`;
- Qwen3-Next / Qwen2-MoE only: `block.shared_expert` (a dense MLP) and `block.shared_expert_gate`.

A forward hook on `block.gate` that returns `(logits, weights, new_ids)` makes the block compute
expert `new_ids[n, j]` with slot weight `weights[n, j]`: this is how substitution is emulated.

`load_model` loads a checkpoint whole on one device, or placed by Accelerate (`ModelLoading`:
layers over CUDA devices, the CPU and the disk) when it does not fit one; the router hook and
`stream_nll` work the same on both (`input_device` names where a placed model's inputs go).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from moesub.config import schema_defaults
from moesub.params import options_from

# model_type -> whether the router always renormalizes its top-k weights (no config flag).
_FAMILIES: dict[str, bool] = {
    "qwen3_next": False,
    "qwen3_moe": False,
    "qwen2_moe": False,
    "olmoe": False,
    "flex_olmo": False,
    "mixtral": True,
}
SUPPORTED_FAMILIES = tuple(sorted(_FAMILIES))
# model_type -> the decoder layer's norm between the residual stream and the MoE block (None:
# the block reads the residual stream itself; FlexOlmo normalizes after its MLP instead).
_PRE_MOE_NORM: dict[str, str | None] = {f: "post_attention_layernorm" for f in _FAMILIES}
_PRE_MOE_NORM["flex_olmo"] = None
_BLOCK_ATTRS = ("mlp", "block_sparse_moe")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

RouteFn = Callable[..., Any]  # (layer, logits, weights, ids[, lookahead]) -> see RouterHook


@dataclass(frozen=True)
class MoEInfo:
    """Routing geometry of an MoE model (the same in every MoE layer)."""

    family: str  # config.model_type
    num_layers: int  # number of MoE layers L
    layer_indices: tuple[int, ...]  # decoder-layer index of each MoE layer, ascending
    num_experts: int  # routed experts per layer E
    top_k: int  # experts selected per token k
    norm_topk_prob: bool  # top-k weights renormalized to sum 1
    hidden_size: int  # H
    expert_width: int  # I (an expert's intermediate size)
    has_shared_expert: bool
    vocab_size: int

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["layer_indices"] = list(self.layer_indices)
        return d


# --------------------------------------------------------------------------------------------
# structure


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"model {type(model).__name__}: no decoder layer list at `model.model.layers`"
        )
    return layers


def _family(model: nn.Module) -> str:
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in _FAMILIES:
        raise ValueError(
            f"model family {family!r} ({type(model).__name__}) is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def _is_sparse_block(block: nn.Module | None) -> bool:
    experts = getattr(block, "experts", None)
    gate = getattr(block, "gate", None)
    return (
        isinstance(gate, nn.Module)
        and isinstance(getattr(gate, "weight", None), torch.Tensor)
        and hasattr(gate, "top_k")
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


def _moe_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder-layer index, sparse block) for every MoE layer, in layer order."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        for attr in _BLOCK_ATTRS:
            block = getattr(layer, attr, None)
            if _is_sparse_block(block):
                out.append((i, block))
                break
    return out


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks of `model`, in layer order (MoE layer l is element l)."""
    _family(model)
    blocks = [b for _, b in _moe_layers(model)]
    if not blocks:
        raise ValueError(f"model {type(model).__name__} has no sparse MoE layer")
    return blocks


def expert_weights(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's fused expert parameters `(gate_up [E, 2I, H], down [E, H, I])` (not copies)."""
    if not _is_sparse_block(block):
        raise ValueError(f"{type(block).__name__} is not a sparse MoE block")
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    E, two_i, H = gate_up.shape
    if down.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(
            f"{type(block).__name__}: unexpected expert layout gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)} (expected [E, 2I, H] and [E, H, I])"
        )
    return gate_up, down


def moe_info(model: nn.Module) -> MoEInfo:
    """Measure the routing geometry from the model's modules (works on a meta-device model)."""
    family = _family(model)
    layers = _moe_layers(model)
    if not layers:
        raise ValueError(f"model {type(model).__name__} ({family}) has no sparse MoE layer")
    geoms = set()
    for _, block in layers:
        gate_up, _ = expert_weights(block)
        E, two_i, H = gate_up.shape
        router = block.gate
        norm = bool(getattr(router, "norm_topk_prob", False)) or _FAMILIES[family]
        geoms.add((E, int(router.top_k), norm, H, two_i // 2, hasattr(block, "shared_expert")))
    if len(geoms) != 1:
        raise ValueError(f"model {type(model).__name__}: MoE layers differ in geometry: {geoms}")
    E, k, norm, H, width, shared = geoms.pop()
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    return MoEInfo(
        family=family,
        num_layers=len(layers),
        layer_indices=tuple(i for i, _ in layers),
        num_experts=E,
        top_k=k,
        norm_topk_prob=norm,
        hidden_size=H,
        expert_width=width,
        has_shared_expert=shared,
        vocab_size=int(cfg.vocab_size),
    )


# --------------------------------------------------------------------------------------------
# loading


def _check_dir(path: str | os.PathLike) -> Path:
    from moesub.config import check_checkpoint_dir

    return check_checkpoint_dir(path, "model path")


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

    p = _check_dir(path)
    has_weights = any((p / f).is_file() for f in _WEIGHT_FILES) or any(p.glob("*.safetensors"))
    if not has_weights:
        raise ValueError(
            f"{str(p)!r} is not a complete checkpoint: no weight files ({', '.join(_WEIGHT_FILES)})"
        )
    has_tokenizer(p, required=tokenizer)
    config = _load_config(p)
    family = getattr(config, "model_type", None)
    if family not in _FAMILIES:
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


def input_device(model: nn.Module) -> torch.device:
    """The device a forward's input ids go to: the input embedding's execution device when
    Accelerate placed the model (its weight may sit on the meta device, offloaded), else the
    embedding weight's device."""
    embed = model.get_input_embeddings()
    hook = getattr(embed, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is None:
        return embed.weight.device
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


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


def has_tokenizer(path: str | os.PathLike, required: bool = False) -> bool:
    """Whether checkpoint `path` holds tokenizer files (`required`: raise if it does not).

    Without them transformers may still build a tokenizer from config.json alone, with an empty
    vocabulary, and every document then tokenizes to nothing."""
    p = Path(path)
    found = any((p / f).is_file() for f in _TOKENIZER_FILES)
    if required and not found:
        raise FileNotFoundError(
            f"{str(p)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): copy the "
            "tokenizer files of the model it was trained from into the checkpoint directory"
        )
    return found


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
# router hook


def _moe_taps(model: nn.Module) -> list[tuple[nn.Module, nn.Module | None, nn.Module]]:
    """Per MoE layer: (decoder layer, its pre-MoE norm or None, its sparse block)."""
    layers = _decoder_layers(model)
    attr = _PRE_MOE_NORM[_family(model)]
    out = []
    for i, block in _moe_layers(model):
        norm = getattr(layers[i], attr) if attr is not None else None
        out.append((layers[i], norm, block))
    return out


def _execution_device(module: nn.Module, fallback: torch.device) -> torch.device:
    """Where `module` computes: Accelerate's execution device when it placed the module, else
    its first parameter's device (`fallback` for a module without parameters)."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is not None:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    param = next(module.parameters(), None)
    if param is None or param.device.type == "meta":
        return fallback
    return param.device


def router_weights(
    logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool
) -> torch.Tensor:
    """The slot weights a TopKRouter gives experts `experts [N, k]` (slot order) from its logits
    `[N, E]`: softmax in float32 over all E, gathered, renormalized over the k when
    `norm_topk_prob`, cast to the logits' dtype. For the router's own top-k these are its weights
    bit for bit; cache-aware routing (route_bias) computes a rerouted row's weights with it."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top = probs.gather(1, experts.to(device=probs.device, dtype=torch.long))
    if norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


class RouterHook:
    """Context manager: call `on_route` at every MoE layer's router, optionally replacing ids.

    `on_route(layer, logits, weights, ids)` gets the MoE layer index `l` (0..L-1), the router
    logits `[N, E]` as float32 (N = B*T rows, row-major over (batch, time); do not modify),
    the slot weights `[N, k]` and selected ids `[N, k]` in the model's slot order. It returns
    None (keep the model's choice), replacement ids `[N, k]` in the same slot order (slot j
    then computes expert `new[n, j]` with the unchanged weight `weights[n, j]`), or a pair
    `(weights, ids)` replacing both (cache-aware routing selects other experts).
    With `on_route` returning None or the same ids, the model's output is bit-identical.

    `lookahead=True` also passes each layer's lookahead logits `[N, E]` float32 as a fifth
    argument (docs/policy-semantics.md, v2 `prefetch`): layer l's router applied, through layer
    l's own pre-MoE norm, to the residual stream entering MoE layer l-1's MoE sub-block (for
    MoE layer 0: the residual stream entering its decoder layer), recorded by forward pre-hooks
    during the same forward. Norm and router are the model's own modules, called on that
    stream: the lookahead is exactly what the router would compute one MoE layer earlier.
    """

    def __init__(self, model: nn.Module, on_route: RouteFn, lookahead: bool = False):
        if lookahead:
            for block in moe_blocks(model):
                if not type(block.gate).__name__.endswith("TopKRouter"):
                    raise ValueError(
                        f"RouterHook lookahead: router {type(block.gate).__name__} is not a "
                        "transformers TopKRouter (logits = F.linear(hidden, weight))"
                    )
        self.model = model
        self.on_route = on_route
        self.lookahead = bool(lookahead)
        self.blocks = moe_blocks(model)
        self._taps = _moe_taps(model) if self.lookahead else []
        self._handles: list[Any] = []
        self._streams: list[torch.Tensor | None] = []  # [entering MoE layer 0's decoder layer,
        # entering MoE layer 0's MoE sub-block, ..., layer L-2's]: lookahead sources
        self._inner = False  # True while the hook itself runs a norm / router (no recording)

    def _make_hook(self, layer: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._inner:
                return None
            logits, weights, ids = output  # [N, E], [N, k], [N, k]
            if self.lookahead:
                y = self._lookahead_logits(layer, logits.device)
                new = self.on_route(layer, logits.float(), weights, ids, y)
            else:
                new = self.on_route(layer, logits.float(), weights, ids)
            if new is None:
                return None
            if isinstance(new, tuple):
                new_weights, new = new
                new_weights = torch.as_tensor(new_weights, device=weights.device)
                new_weights = new_weights.to(weights.dtype)
                if new_weights.shape != weights.shape:
                    raise ValueError(
                        f"on_route for layer {layer} returned weights of shape "
                        f"{tuple(new_weights.shape)}, expected {tuple(weights.shape)}"
                    )
            else:
                new_weights = weights
            new = torch.as_tensor(new, device=ids.device).to(ids.dtype)
            if new.shape != ids.shape:
                raise ValueError(
                    f"on_route for layer {layer} returned ids of shape {tuple(new.shape)}, "
                    f"expected {tuple(ids.shape)}"
                )
            return logits, new_weights, new

        return hook

    def _make_tap(self, index: int, kwarg: str | None):
        """Forward pre-hook keeping a module's input (the residual stream) as source `index`."""

        def tap(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._inner:
                return None
            x = args[0] if args else kwargs[kwarg] if kwarg else None
            if x is None:
                raise RuntimeError(f"{type(module).__name__}: no hidden-state input to record")
            self._streams[index] = x.detach()
            return None

        return tap

    def _lookahead_logits(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer `layer`'s lookahead logits `[N, E]` float32 from its recorded source stream."""
        source = self._streams[layer]
        if source is None:
            raise RuntimeError(f"lookahead of MoE layer {layer}: its residual stream was not seen")
        self._streams[layer] = None  # each source feeds one layer: free it
        _decoder, norm, block = self._taps[layer]
        self._inner = True
        try:
            x = source
            if norm is not None:
                x = norm(x.to(_execution_device(norm, x.device)))
            x = x.to(_execution_device(block.gate, x.device)).reshape(-1, x.shape[-1])
            gate = block.gate
            if gate.weight.device.type != "meta" and not hasattr(gate, "_hf_hook"):
                # a TopKRouter's logits are F.linear(hidden, weight): skip its softmax and top-k
                y = nn.functional.linear(x, gate.weight)
            else:  # Accelerate loads an offloaded weight for the module's own forward
                y = gate(x)[0]
        finally:
            self._inner = False
        return y.float().to(device)

    def __enter__(self) -> RouterHook:
        if self._handles:
            raise RuntimeError("RouterHook is already installed")
        for layer, block in enumerate(self.blocks):
            self._handles.append(block.gate.register_forward_hook(self._make_hook(layer)))
        if self.lookahead:
            L = len(self._taps)
            self._streams = [None] * L
            decoder0 = self._taps[0][0]
            self._handles.append(
                decoder0.register_forward_pre_hook(
                    self._make_tap(0, "hidden_states"), with_kwargs=True
                )
            )
            for m in range(L - 1):  # the last MoE layer's stream is no layer's source
                _decoder, norm, block = self._taps[m]
                module = norm if norm is not None else block
                self._handles.append(
                    module.register_forward_pre_hook(self._make_tap(m + 1, None), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._streams = []


def align_ids(
    model_ids: torch.Tensor,
    selected: torch.Tensor | np.ndarray,
    computed: torch.Tensor | np.ndarray,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map the policy core's per-rank result onto the model's slot order.

    `selected[n, r]` is the core's rank-r expert (top-k by logit, ties to the lower id) and
    `computed[n, r]` the expert it actually computes for that rank; `model_ids[n, j]` is the
    model's slot-j expert. Returns `new[n, j] = computed[n, r]` where `selected[n, r] ==
    model_ids[n, j]` (vectorised), on `model_ids`' device and dtype.

    The two selections are the same SET except at an exact tie at the k-th place (two experts
    with equal router probability; the model's `torch.topk` may break it either way). Without
    `logits` such a row raises ValueError. With `logits` `[N, E]` (the router logits the hook
    received) a row whose differing experts have identical probabilities is resolved by giving
    the model's tied slot the core's tied rank (the slot weight is the same either way); any
    other mismatch still raises.
    """
    sel = torch.as_tensor(selected, device=model_ids.device).long()  # [N, k]
    comp = torch.as_tensor(computed, device=model_ids.device).to(model_ids.dtype)  # [N, k]
    mid = model_ids.long()  # [N, k]
    if sel.shape != mid.shape or comp.shape != mid.shape:
        raise ValueError(
            f"align_ids: shapes differ: model_ids {tuple(mid.shape)}, selected "
            f"{tuple(sel.shape)}, computed {tuple(comp.shape)}"
        )
    eq = mid[:, :, None] == sel[:, None, :]  # [N, k(slot), k(rank)]
    ok = eq.sum(-1) == 1  # [N, k]
    rank = eq.to(torch.int8).argmax(-1)  # [N, k]: matching rank per slot
    bad = (~ok.all(-1)).nonzero().flatten()
    if bad.numel():
        if logits is None:
            n = int(bad[0])
            raise ValueError(
                f"align_ids: {bad.numel()} row(s) where the model's top-k set differs from the "
                f"policy core's (a tie at the k-th place), e.g. row {n}: model "
                f"{sorted(mid[n].tolist())} vs core {sorted(sel[n].tolist())}; pass the "
                "router logits to resolve exact ties"
            )
        rank = _resolve_ties(mid, sel, eq, rank, bad, logits)
    return comp.gather(1, rank)


def _resolve_ties(mid, sel, eq, rank, bad, logits):
    probs = torch.softmax(logits.float(), dim=-1)  # as the router computes them, all rows
    rank = rank.clone()
    for n in bad.tolist():  # rare rows only
        slots = (eq[n].sum(-1) != 1).nonzero().flatten()  # model slots without a match
        ranks = (eq[n].sum(0) != 1).nonzero().flatten()  # core ranks without a match
        p_model = probs[n, mid[n, slots]]
        p_core = probs[n, sel[n, ranks]]
        if (
            len(slots) != len(ranks)
            or (eq[n].sum(-1) > 1).any()
            or not torch.equal(p_model, p_model[0].expand_as(p_model))
            or not torch.equal(p_core, p_model[0].expand_as(p_core))
        ):
            raise ValueError(
                f"align_ids: row {n}: the model's top-k set {sorted(mid[n].tolist())} differs "
                f"from the policy core's {sorted(sel[n].tolist())} and not by an exact tie"
            )
        rank[n, slots] = ranks
    return rank


# --------------------------------------------------------------------------------------------
# exact teacher-forced NLL


def stream_batches(lengths: Sequence[int], batch_tokens: int | None) -> list[list[int]]:
    """Group streams into teacher-forced forward batches: runs of consecutive streams of equal
    length, at most `batch_tokens` tokens per batch (always >= 1 stream); None = one stream per
    forward. Capture, emulation and Experiment B batch with this one function and the capture's
    `batch_tokens`: the (B, T) of every forward must match for bit-identical NLL."""
    if batch_tokens is not None and (isinstance(batch_tokens, bool) or int(batch_tokens) < 1):
        raise ValueError(f"batch_tokens must be an integer >= 1 or None, got {batch_tokens!r}")
    batches: list[list[int]] = []
    for i, n in enumerate(lengths):
        last = batches[-1] if batches else None
        if (
            last is not None
            and batch_tokens is not None
            and lengths[last[0]] == n
            and (len(last) + 1) * n <= batch_tokens
        ):
            last.append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def stream_nll(model: nn.Module, input_ids: torch.Tensor, chunk: int | None = None) -> np.ndarray:
    """Per-token NLL `[B, T]` float64 (NaN at position 0) from ONE teacher-forced forward.

    The single forward used by capture and emulate (bit-exactness between them depends on it):
    `model(input_ids, use_cache=False)` in the model's dtype, then log-softmax in float32 over
    the vocabulary, cast to float64. The log-softmax runs over `chunk` positions at a time
    (default: about 2^18 logits per chunk on CPU, 2^26 on GPU); results do not depend on it.
    On CPU, small chunks matter: one [T, V] log-softmax buffer made the NLL cost 23% of a
    forward of the tiny model (fresh large allocations page-fault), 32-row chunks 4%.
    Note: the batch composition (B, T) must also match for bit-identical results.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    device = input_device(model)
    ids = input_ids.to(device=device, dtype=torch.long)  # [B, T]
    logits = model(input_ids=ids, use_cache=False).logits  # [B, T, V]
    B, T, V = logits.shape
    targets = ids.to(logits.device)  # a placed model's head may sit on another device
    if chunk is None:
        budget = 2**18 if device.type == "cpu" else 2**26
        chunk = max(1, budget // (B * V))
    out = torch.full((B, T), float("nan"), dtype=torch.float64)
    for s in range(0, T - 1, chunk):
        e = min(s + chunk, T - 1)
        lp = torch.log_softmax(logits[:, s:e].float(), dim=-1)  # [B, e-s, V]
        tok = lp.gather(-1, targets[:, s + 1 : e + 1, None]).squeeze(-1)  # [B, e-s]
        out[:, s + 1 : e + 1] = -tok.double().cpu()
    return out.numpy()
