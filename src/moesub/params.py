"""Options dataclasses from config sections: unknown keys are errors that name the key; the
`dtype` and `device` options every torch stage shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from moesub.config.schema import check_options, config_schema

T = TypeVar("T")

# The model / expert dtypes a stage may be asked for (config `dtype:`), by name: the schema's
# one list (`$defs/dtype`).
DTYPE_NAMES: tuple[str, ...] = tuple(config_schema()["$defs"]["dtype"]["enum"])


def options_from(
    cls: type[T],
    params: Mapping[str, Any] | None,
    what: str,
    section: str | tuple[str, ...] | None = None,
) -> T:
    """`cls(**params)` after checking every key is a field of `cls` (`what` names the section)
    and, given the config `section`(s) they come from, every value the schema knows against it
    (`moesub.config.check_options`: types, ranges and choices live in the schema)."""
    params = dict(params or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"params: unknown {what} option(s) {unknown}; known: {sorted(known)}")
    if section is not None:
        check_options(params, section, what)
    return cls(**params)


def torch_device(name: str):
    """A stage's `device` option: "auto" (CUDA if available, else CPU), "cpu", "cuda[:n]"...;
    asking for CUDA without it is an error before any work."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"params.device={name!r} but CUDA is not available")
    return torch.device(name)


def check_dtype(name: Any, what: str = "params.dtype") -> str:
    """A stage's `dtype` option: one of DTYPE_NAMES (`what` names the option in the error)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"{what}: {name!r} is not one of {list(DTYPE_NAMES)}")
    return name


def torch_dtype(name: str):
    """The torch dtype of a `dtype` option (checked)."""
    import torch

    return getattr(torch, check_dtype(name))
