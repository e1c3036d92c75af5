"""Rule engine: the real offloading engine under one policy (moesub.engine.run_engine)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.engine.stage import run_engine
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_engine(
    snakemake.params.model_dir,
    snakemake.input.tokens,
    snakemake.input.ranking,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.size,
    snakemake.wildcards.device,
    snakemake.output[0],
    snakemake.params.engine,
    allocation_path=snakemake.input.get("allocation"),
)
