"""Rule calibrate: this machine's hardware profile fitted to timed engine runs (moesub.engine)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.engine.calibrate import calibrate
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

calibrate(
    snakemake.params.model_dir,
    snakemake.wildcards.device,
    snakemake.input.tokens,
    snakemake.input.ranking,
    snakemake.params.size,
    snakemake.output[0],
    snakemake.params.engine,
)
