"""Rule initial_sets: frequency-initial resident sets per cache fraction (moesub.capture)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.capture import write_initial_sets
from moesub.logs import job_setup

job_setup(snakemake.log[0])

write_initial_sets(snakemake.input[0], snakemake.params.fractions, snakemake.output[0])
