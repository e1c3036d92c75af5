"""Rule simulate: replay the captured router trace under one policy (moesub.simulate)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.simulate import run_simulate

job_setup(snakemake.log[0])

run_simulate(
    snakemake.input.router,
    snakemake.input.ranking,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.size,
    snakemake.output.table,
    snakemake.output.counts,
    coactivation_path=snakemake.input.get("coactivation"),
    allocation_path=snakemake.input.get("allocation"),
)
