"""Pipeline configuration: schema defaults, policy expansion, model geometry, capacity and
input-path checks.

The Snakemake workflow (workflow/rules/common.smk) imports these at parse time, after the JSON
schema has validated `config.yaml`, so that every error is raised before any job runs and names
the offending key. They are plain functions of the config dict, usable outside Snakemake too
(`load_config` = read YAML + schema + the checks below). `moesub.config` is the public API; its
parts, each one concept:

- `schema`: the schema file, the defaults it owns (`schema_defaults`), `check_options`,
  `fill_defaults`;
- `names`: names as path components (`check_name`), `number_label`, `canonical` params;
- `policies`: `normalize_policy`, `expand_policies` (sweeps), admission twins, `stage_policies`;
- `inputs`: checkpoint directories and every local input path (`input_paths`);
- `geometry`: each model's (E, k) and every capacity rule (`check_capacities`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moesub.config.geometry import (
    REGIME_FRACTION,
    check_capacities,
    expb_min_capacity,
    model_geometry,
    read_checkpoint_geometry,
)
from moesub.config.inputs import check_checkpoint_dir, check_input_paths, input_paths
from moesub.config.names import FACTORIAL_CELLS, canonical, check_name, number_label
from moesub.config.policies import (
    ALL_RESIDENT,
    ALL_RESIDENT_POLICY,
    ONLINE_STAGES,
    POLICY_DEFAULTS,
    POLICY_KEYS,
    V2_POLICY_KEYS,
    expand_policies,
    is_exact_twin,
    is_offline,
    missing_admission_twins,
    normalize_policy,
    policy_subset,
    stage_policies,
    twin_spec,
)
from moesub.config.schema import (
    SCHEMA_PATH,
    check_options,
    config_schema,
    fill_defaults,
    schema_defaults,
    schema_section,
)

__all__ = [
    "ALL_RESIDENT",
    "ALL_RESIDENT_POLICY",
    "FACTORIAL_CELLS",
    "ONLINE_STAGES",
    "POLICY_DEFAULTS",
    "POLICY_KEYS",
    "REGIME_FRACTION",
    "SCHEMA_PATH",
    "V2_POLICY_KEYS",
    "canonical",
    "check_capacities",
    "check_checkpoint_dir",
    "check_input_paths",
    "check_name",
    "check_options",
    "config_schema",
    "expand_policies",
    "expb_min_capacity",
    "fill_defaults",
    "input_paths",
    "is_exact_twin",
    "is_offline",
    "load_config",
    "missing_admission_twins",
    "model_geometry",
    "normalize_policy",
    "number_label",
    "policy_subset",
    "read_checkpoint_geometry",
    "schema_defaults",
    "schema_section",
    "stage_policies",
    "twin_spec",
]


def load_config(path: str | Path, schema_path: str | Path | None = None) -> dict[str, Any]:
    """Read a pipeline config YAML, validate it against the schema (defaults filled), check it.

    The same checks the workflow runs at parse time; raises `ValueError` naming the key.
    """
    import jsonschema
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found")
    config = yaml.safe_load(path.read_text()) or {}
    schema = (
        config_schema() if schema_path is None else yaml.safe_load(Path(schema_path).read_text())
    )
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        err = errors[0]
        key = ".".join(str(p) for p in err.absolute_path) or "<top level>"
        raise ValueError(f"config {str(path)!r}: {key}: {err.message}")
    fill_defaults(config)
    stage_policies(config, expand_policies(config))
    check_capacities(config)
    check_input_paths(config)
    return config
