"""Rule generate: greedy generation for one task under one policy (moesub.generate)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.generate import run_generate
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_generate(
    snakemake.params.model_dir,
    snakemake.wildcards.task,
    snakemake.params.data_path,
    snakemake.input.ranking,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.size,
    snakemake.output[0],
    snakemake.params.generate,
    snakemake.params.engine,
    allocation_path=snakemake.input.get("allocation"),
)
