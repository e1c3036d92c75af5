"""Pipeline configuration: schema validation and defaults, policy expansion, model geometry,
capacity and input-path checks.

The Snakemake workflow (Snakefile, workflow/rules/common.smk) runs these at parse time, so that
every error is raised before any job runs and names the offending key in a few lines. They are
plain functions of the config dict, usable outside Snakemake too (`load_config` = read YAML +
`validate_config` + the checks below). The package loads neither the policy core nor torch: its
policy words come from `moesub.vocabulary`. `moesub.config` is the public API; its parts, each
one concept:

- `schema`: the schema file, the defaults it owns (`schema_defaults`), `check_options`;
- `validation`: `validate_config` (the schema's checks and defaults, short errors);
- `names`: names as path components (`check_name`), `number_label`, `canonical` params;
- `policies`: `normalize_policy`, `policy_spec`, `expand_policies` (sweeps), admission twins,
  `stage_policies`;
- `inputs`: checkpoint directories (config.json, tokenizer files) and every local input path
  (`input_paths`);
- `geometry`: each model's (E, k) and pricing geometry (what its experts weigh);
- `sizes`: cache sizes (fractions, byte budgets) resolved per model (`model_sizes`), the sizes
  each stage runs at (`stage_sizes`), the regime's (`regime_size`), pin specs at every size
  (`check_pins`) and every other capacity rule (`check_capacities`);
- `hardware`: the profiles priced (`priced_hardware`), the user's own (`user_profiles`), the
  bytes a model is priced at (`pricing_bytes`: its pricing geometry at its `expert_bits`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moesub.config.geometry import (
    expb_min_capacity,
    model_geometry,
    pricing_geometry,
    read_checkpoint_geometry,
    read_pricing_geometry,
)
from moesub.config.hardware import priced_hardware, pricing_bytes, profile_spec, user_profiles
from moesub.config.inputs import (
    TOKENIZER_FILES,
    check_checkpoint_dir,
    check_input_paths,
    has_tokenizer,
    input_paths,
)
from moesub.config.names import FACTORIAL_CELLS, canonical, check_name, number_label
from moesub.config.policies import (
    ONLINE_STAGES,
    POLICY_DEFAULTS,
    POLICY_KEYS,
    V2_POLICY_KEYS,
    expand_policies,
    is_exact_twin,
    is_offline,
    is_planned,
    missing_admission_twins,
    normalize_policy,
    policy_spec,
    policy_subset,
    stage_policies,
    twin_spec,
)
from moesub.config.schema import (
    SCHEMA_PATH,
    check_options,
    config_schema,
    schema_defaults,
    schema_section,
)
from moesub.config.sizes import (
    REGIME_FRACTION,
    SIZE_STAGES,
    check_capacities,
    check_pins,
    configured_sizes,
    expert_bits,
    model_sizes,
    regime_size,
    size_labels,
    stage_sizes,
)
from moesub.config.validation import validate_config
from moesub.vocabulary import ALL_RESIDENT, ALL_RESIDENT_POLICY

__all__ = [
    "ALL_RESIDENT",
    "ALL_RESIDENT_POLICY",
    "FACTORIAL_CELLS",
    "ONLINE_STAGES",
    "POLICY_DEFAULTS",
    "POLICY_KEYS",
    "REGIME_FRACTION",
    "SCHEMA_PATH",
    "SIZE_STAGES",
    "TOKENIZER_FILES",
    "V2_POLICY_KEYS",
    "canonical",
    "check_capacities",
    "check_checkpoint_dir",
    "check_input_paths",
    "check_name",
    "check_pins",
    "check_options",
    "config_schema",
    "configured_sizes",
    "expand_policies",
    "expb_min_capacity",
    "expert_bits",
    "has_tokenizer",
    "input_paths",
    "is_exact_twin",
    "is_offline",
    "is_planned",
    "load_config",
    "missing_admission_twins",
    "model_geometry",
    "model_sizes",
    "normalize_policy",
    "number_label",
    "policy_spec",
    "policy_subset",
    "priced_hardware",
    "pricing_bytes",
    "pricing_geometry",
    "profile_spec",
    "read_checkpoint_geometry",
    "read_pricing_geometry",
    "regime_size",
    "schema_defaults",
    "schema_section",
    "size_labels",
    "stage_policies",
    "stage_sizes",
    "twin_spec",
    "user_profiles",
    "validate_config",
]


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a pipeline config YAML, validate it against the schema (defaults filled), check it.

    The same checks the workflow runs at parse time; raises `ValueError` naming the key."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found")
    config = yaml.safe_load(path.read_text()) or {}
    try:
        validate_config(config)
    except ValueError as e:
        raise ValueError(f"config file {str(path)!r}:\n{e}") from None
    policies = expand_policies(config)
    stage_policies(config, policies)
    check_capacities(config)
    check_pins(config, policies)
    stage_sizes(config)
    check_input_paths(config)
    priced_hardware(config)
    return config
