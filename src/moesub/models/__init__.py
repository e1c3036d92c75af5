"""Adapters for transformers' sparse-MoE causal LMs: structure, loading, router hook, exact NLL.

`moesub.models` is the public API; its parts, each one concept:

- `families`: the supported families (Qwen3-Next, Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo,
  Mixtral), one adapter each (`MoEFamily`, `moe_family(model)`: where its sparse blocks,
  routers, experts and shared expert sit, its router's output, its experts in the engine's
  layout), and what they measure (`moe_blocks`, `moe_info` -> `MoEInfo`);
- `loading`: checkpoint and tokenizer checks, `load_model` whole on one device or placed by
  Accelerate (`ModelLoading`: layers over CUDA devices, the CPU and the disk), `input_device`;
- `routing`: `RouterHook` (observe or replace every MoE layer's routing during a forward, with
  the lookahead logits on request), `align_ids`, `router_weights`;
- `nll`: `stream_batches` and `stream_nll`, the one teacher-forced forward that capture,
  emulation and Experiment B share (bit-exactness between them depends on it);
- `cache`: `cached_forward`, one decoding forward with the KV cache under the name the
  installed transformers gives it (`cache_argument`).

The router hook and `stream_nll` work the same on a model loaded whole and on a placed one.
"""

from moesub.models.cache import cache_argument, cached_forward
from moesub.models.families import (
    SUPPORTED_FAMILIES,
    MoEFamily,
    MoEInfo,
    moe_blocks,
    moe_family,
    moe_info,
)
from moesub.models.loading import (
    DEVICE_MAP_STRATEGIES,
    ModelLoading,
    check_checkpoint,
    has_tokenizer,
    input_device,
    load_model,
    load_tokenizer,
)
from moesub.models.nll import stream_batches, stream_nll
from moesub.models.routing import RouteFn, RouterHook, align_ids, router_weights

__all__ = [
    "DEVICE_MAP_STRATEGIES",
    "SUPPORTED_FAMILIES",
    "MoEFamily",
    "MoEInfo",
    "ModelLoading",
    "RouteFn",
    "RouterHook",
    "align_ids",
    "cache_argument",
    "cached_forward",
    "check_checkpoint",
    "has_tokenizer",
    "input_device",
    "load_model",
    "load_tokenizer",
    "moe_blocks",
    "moe_family",
    "moe_info",
    "router_weights",
    "stream_batches",
    "stream_nll",
]
