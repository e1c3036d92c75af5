"""Rule hardware_profile: one hardware profile priced for the model (moesub.price)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.price import write_profile

job_setup(snakemake.log[0])

write_profile(
    snakemake.wildcards.hardware,
    snakemake.params.spec,
    snakemake.input.get("calibration"),
    snakemake.params.model_bytes,
    snakemake.output[0],
    snakemake.input.get("checkpoint"),
)
