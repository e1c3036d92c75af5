"""Rule allocation: a planned policy's per-layer slots at one size (moesub.allocation)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.allocation import run_allocation
from moesub.logs import job_setup

job_setup(snakemake.log[0])

run_allocation(
    snakemake.input.router,
    snakemake.input.ranking,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.size,
    snakemake.output[0],
    coactivation_path=snakemake.input.get("coactivation"),
)
