"""Rule cost_model: the engine's calibration with config.yaml `cost:` overrides applied."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.simulate import write_cost_model

job_setup(snakemake.log[0])

write_cost_model(
    snakemake.input.get("calibration"), snakemake.params.overrides, snakemake.output[0]
)
