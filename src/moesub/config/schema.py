"""The pipeline's JSON schema: where it lives, the defaults it owns, value checks against it.

The schema (workflow/schemas/config.schema.yaml) owns every default: `schema_defaults(section)`
reads them, and tests/test_config_defaults.py holds every options dataclass's defaults equal to
the schema's. `check_options` checks a stage's params against the same schema
(`moesub.config.validation` checks a whole config and fills its defaults).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The repository's schema (an editable install); a wheel carries a copy in the moesub package
# directory (CMakeLists.txt installs it there).
_REPO_SCHEMA = Path(__file__).resolve().parents[3] / "workflow" / "schemas" / "config.schema.yaml"
SCHEMA_PATH = (
    _REPO_SCHEMA if _REPO_SCHEMA.is_file() else Path(__file__).parents[1] / _REPO_SCHEMA.name
)


@functools.cache
def config_schema() -> dict[str, Any]:
    """The pipeline's JSON schema (read once)."""
    import yaml

    if not SCHEMA_PATH.is_file():
        raise FileNotFoundError(
            f"config schema {str(_REPO_SCHEMA)!r} not found (nor a copy in the moesub package)"
        )
    return yaml.safe_load(SCHEMA_PATH.read_text())


def resolve(node: Mapping[str, Any]) -> dict[str, Any]:
    """A schema node with its `$ref` (to `#/$defs/...`) merged in; the node's own keys win."""
    node = dict(node)
    while "$ref" in node:
        ref = node.pop("$ref")
        target = config_schema()["$defs"][ref.removeprefix("#/$defs/")]
        node = {**target, **node}
    return node


def schema_section(section: str) -> dict[str, Any]:
    """The schema node of a config section (dotted keys, `*` = any name; see schema_defaults)."""
    node = resolve(config_schema())
    for key in section.split("."):
        node = resolve(node["additionalProperties"] if key == "*" else node["properties"][key])
    return node


def check_options(values: Mapping[str, Any], sections: str | tuple[str, ...], what: str) -> None:
    """Every value whose key the config sections' schema knows, checked against it (type, range,
    enum: the schema is their one home; dataclasses keep the cross-field checks). The first
    section that knows a key gives its schema. Raises ValueError naming `params.<key>`."""
    import jsonschema

    props: dict[str, Any] = {}
    for section in (sections,) if isinstance(sections, str) else sections:
        for key, prop in schema_section(section).get("properties", {}).items():
            props.setdefault(key, prop)
    known = {key: props[key] for key in values if key in props}
    schema = {"$defs": config_schema()["$defs"], "type": "object", "properties": known}
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(dict(values)), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        key = str(err.absolute_path[0]) if err.absolute_path else "?"
        raise ValueError(f"params.{key}={values.get(key)!r} ({what}): {err.message}")


def schema_defaults(section: str) -> dict[str, Any]:
    """The schema's default of every key of a config section that has one (deep copies).

    `section`: dotted keys through the schema's `properties` ("emulate", "engine.bench",
    "generate.tasks.gsm8k"); `*` stands for any name of a name -> object map ("policies.*").
    """
    out = {}
    for key, prop in schema_section(section).get("properties", {}).items():
        prop = resolve(prop)
        if "default" in prop:
            out[key] = copy.deepcopy(prop["default"])
    return out
