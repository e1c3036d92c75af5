"""Rule engine: the calibration and every policy's engine runs of one model on one device,
interleaved (moesub.engine.run_engine_stage)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.engine.stage import run_engine_stage
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_engine_stage(
    snakemake.params.model_dir,
    snakemake.wildcards.device,
    snakemake.input.tokens,
    snakemake.input.calib_tokens,
    snakemake.input.ranking,
    dict(zip(snakemake.output.runs, snakemake.params.runs, strict=True)),
    snakemake.params.calibration_size,
    snakemake.output.calibration,
    snakemake.params.engine,
)
