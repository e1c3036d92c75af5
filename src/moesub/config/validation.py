"""The config checked against the schema, its defaults filled, a bad key named in a few lines.

`validate_config` replaces Snakemake's `validate` (which printed the whole schema and config
with each error): the first problem becomes one short `ValueError` giving the key's path, what
is wrong and what is allowed there. Defaults are filled exactly as Snakemake's validator did
(tests/test_config_defaults.py holds the two equal on the shipped configs).
"""

from __future__ import annotations

import copy
import difflib
import functools
import re
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from moesub.config.schema import config_schema, resolve

_REPR = reprlib.Repr()  # a value in a message: long strings and containers shortened
_REPR.maxstring = _REPR.maxother = 60
_short = _REPR.repr
_BOUNDS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
)


@functools.cache
def _filling_validator() -> Any:
    """The schema's validator, extended as Snakemake's `validate` did: each object's absent
    keys with a default get it (a deep copy) as the validator reaches that object's
    `properties`, wherever that is ($ref, additionalProperties, a oneOf branch)."""
    import jsonschema

    schema = config_schema()
    base = jsonschema.validators.validator_for(schema)
    check_properties = base.VALIDATORS["properties"]

    check_items = base.VALIDATORS["items"]

    def fill_then_check(validator, properties, instance, node):
        if isinstance(instance, dict):
            for key, prop in properties.items():
                if "default" in prop:
                    instance.setdefault(key, copy.deepcopy(prop["default"]))
                if key in instance:
                    instance[key] = _number_from_string(instance[key], prop)
        yield from check_properties(validator, properties, instance, node)

    def read_then_check(validator, items, instance, node):
        if isinstance(instance, list) and isinstance(items, Mapping):
            instance[:] = [_number_from_string(v, items) for v in instance]
        yield from check_items(validator, items, instance, node)

    extra = {"properties": fill_then_check, "items": read_then_check}
    return jsonschema.validators.extend(base, extra)(schema)


# A float as YAML 1.2 writes it; YAML 1.1 (PyYAML, Snakemake's reader) reads `25e9` and `1e-3`
# as strings (it wants `25.0e+9`), so where the schema expects a number such a string is one.
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")


def _number_from_string(value: Any, node: Mapping[str, Any]) -> Any:
    """`value` as a float where the schema node takes a number but no string and `value` is a
    string written as a number ("25e9"); anything else unchanged (the schema then judges it)."""
    if not isinstance(value, str) or not _FLOAT.match(value.strip()):
        return value
    types = resolve(node).get("type", [])
    types = [types] if isinstance(types, str) else types
    return float(value) if "number" in types and "string" not in types else value


def validate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Check `config` against the schema and fill its defaults in place; returns it.

    The first error (in key order) is raised as a `ValueError` of a few lines: the key's
    path, the problem, the allowed keys or values there."""
    errors = list(_filling_validator().iter_errors(config))
    if errors:
        first = min(errors, key=lambda e: [str(p) for p in e.absolute_path])
        raise ValueError(_config_error(first))
    return config


def _key_path(path: Sequence[str | int]) -> str:
    """`models.m.loading`, `fractions[0]`: a config key as the messages name it."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


def _config_error(err: Any) -> str:
    """A jsonschema error as the few lines `validate_config` raises."""
    path = list(err.absolute_path)
    if err.validator == "additionalProperties":
        known = list(err.schema.get("properties", {}))
        key = next(k for k in err.instance if k not in known)
        under = f"under {_key_path(path)}" if path else "at the top level"
        guess = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        return (
            f"config key {_key_path([*path, key])}: unknown key{hint}\n"
            f"  allowed keys {under}: {', '.join(known)}"
        )
    if err.validator == "required":
        key = next(k for k in err.validator_value if k not in err.instance)
        node = err.schema.get("properties", {}).get(key, {})
        return f"config key {_key_path([*path, key])}: missing (required)\n" + _allowed(node)
    where = _key_path(path) or "<top level>"
    if "propertyNames" in err.schema_path:
        return f"config key {where}: name {_short(err.instance)} is not allowed\n" + _allowed(
            err.schema
        )
    if err.validator == "not":  # a key the other settings rule out: say what they mean
        parent = _key_path(path[:-1])
        return f"config key {where}: not allowed with the other keys of {parent}" + _about(
            _schema_at(path[:-1])
        )
    if err.validator in ("oneOf", "anyOf") and not err.context:
        problem = "matches more than one of the choices"
    else:
        problem = f"{_short(err.instance)} is not allowed"
    return f"config key {where}: {problem}\n" + _allowed(err.schema)


def _schema_at(path: Sequence[str | int]) -> dict[str, Any]:
    """The schema node of a config key (through properties, additionalProperties, items)."""
    node = resolve(config_schema())
    for part in path:
        if isinstance(part, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(part) or node.get("additionalProperties") or {}
        node = resolve(node)
    return node


def _allowed(node: Mapping[str, Any]) -> str:
    """The lines that say what `node` accepts: `allowed: ...` and its description."""
    return f"  allowed: {_describe(node)}" + _about(resolve(node))


def _about(node: Mapping[str, Any]) -> str:
    """The node's description as a line of its own (empty without one)."""
    return f"\n  ({' '.join(node['description'].split())})" if "description" in node else ""


def _describe(node: Mapping[str, Any] | bool) -> str:
    """What a schema node accepts, in a few words."""
    if not isinstance(node, Mapping):
        return "anything" if node else "nothing"
    node = resolve(node)
    if "enum" in node:
        return "one of " + ", ".join("null" if v is None else str(v) for v in node["enum"])
    if "const" in node:
        return repr(node["const"])
    for choice in ("oneOf", "anyOf"):
        if choice in node:
            return " | ".join(_describe(branch) for branch in node[choice])
    types = node.get("type", "string" if "pattern" in node else [])
    words = [_typed(t, node) for t in ([types] if isinstance(types, str) else types)]
    if node.get("required") and not words:
        words = [f"a mapping with key {' and '.join(node['required'])}"]
    return " or ".join(words) or "see the schema"


def _typed(kind: str, node: Mapping[str, Any]) -> str:
    """One JSON type of a node in words ("integer >= 1", "a list, each item ...")."""
    if kind in ("integer", "number"):
        bounds = [f"{op} {node[key]}" for key, op in _BOUNDS if key in node]
        return " and ".join([f"{kind} {bounds[0]}", *bounds[1:]]) if bounds else kind
    if kind == "string" and "pattern" in node:
        return f"a string matching {node['pattern']}"
    if kind == "array":
        return f"a list, each item {_describe(node.get('items', True))}"
    if kind == "object" and node.get("properties"):
        return f"a mapping of {', '.join(node['properties'])}"
    return {"object": "a mapping", "null": "null", "string": "a string"}.get(kind, kind)
