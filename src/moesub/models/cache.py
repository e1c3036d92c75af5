"""One forward with the decoder's KV cache, whatever transformers 5.x names it.

transformers renamed the forward's `past_key_values` argument (and the output's field) to
`cache` within 5.x; pyproject allows every 5.x and GPU images ship older ones (the device
check's had 5.17: there `cache=` fell into `**kwargs` unused and the output had no `.cache`).
The name is read from the model class's forward signature, once per class.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

CACHE_ARGUMENTS = ("cache", "past_key_values")  # newest first


@functools.cache
def cache_argument(model_class: type) -> str:
    """The KV cache's keyword in `model_class.forward` (one of CACHE_ARGUMENTS)."""
    params = inspect.signature(model_class.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in params:
            return name
    raise TypeError(
        f"{model_class.__name__}.forward takes none of {CACHE_ARGUMENTS}: moesub cannot pass "
        "it a KV cache (a transformers version moesub does not know?)"
    )


def cached_forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: Any) -> tuple[Any, Any]:
    """model(input_ids [B, n]) with `cache` (None: a fresh one): (its output, the updated cache)."""
    name = cache_argument(type(model))
    out = model(input_ids=input_ids, use_cache=True, **{name: cache})
    return out, getattr(out, name)
