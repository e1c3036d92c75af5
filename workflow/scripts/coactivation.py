"""Rule coactivation: the co-activation table of the calibration trace (moesub.coactivation)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.coactivation import write_coactivation
from moesub.logs import job_setup

job_setup(snakemake.log[0])

write_coactivation(snakemake.input[0], snakemake.output[0])
