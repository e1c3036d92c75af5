"""Rule calibrate: measure the cost-model parameters on this machine (moesub.engine)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.engine.calibrate import calibrate
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

calibrate(
    snakemake.params.model_dir,
    snakemake.wildcards.device,
    snakemake.output[0],
    snakemake.params.engine,
)
