"""Rule model_embedded: train the embedded default model (moesub.embedded.build_model)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.embedded import build_model
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

build_model(snakemake.params.model_dir, snakemake.params.embedded)
