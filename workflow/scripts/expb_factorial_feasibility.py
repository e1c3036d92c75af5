"""Rule expb_factorial_feasibility: the factorial design's plan on the calibration router logits
(moesub.expb.run_factorial_feasibility); a cell without support fails here, before any model
runs."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.expb import run_factorial_feasibility
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_factorial_feasibility(
    snakemake.input[0],
    snakemake.output[0],
    snakemake.params.spec,
    snakemake.params.seed,
)
