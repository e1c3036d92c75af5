"""Options dataclasses from config sections: unknown keys are errors that name the key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def options_from(cls: type[T], params: Mapping[str, Any] | None, what: str) -> T:
    """`cls(**params)` after checking every key is a field of `cls` (`what` names the section)."""
    params = dict(params or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"params: unknown {what} option(s) {unknown}; known: {sorted(known)}")
    return cls(**params)
