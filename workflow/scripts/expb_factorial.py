"""Rule expb_factorial: Experiment B's factorial design, one cell (moesub.expb.run_factorial)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.expb import run_factorial
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_factorial(
    snakemake.params.model_dir,
    snakemake.input.tokens,
    snakemake.input.ranking,
    snakemake.input.router,
    snakemake.input.feasibility,
    snakemake.wildcards.cell,
    snakemake.output[0],
    snakemake.params.spec,
    snakemake.params.expb,
)
