"""Rule expb_feasibility: the matched design's support and reachable targets on the calibration
router logits (moesub.expb.run_feasibility); an unreachable target fails here, before any model
runs."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.expb import run_feasibility
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_feasibility(
    snakemake.input[0],
    snakemake.output[0],
    snakemake.params.heavy_mass,
    snakemake.params.masses,
)
