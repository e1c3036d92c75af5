"""Rule emulate: exact emulation of one policy (moesub.emulate.run_emulate)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.emulate import run_emulate
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_emulate(
    snakemake.params.model_dir,
    snakemake.input.tokens,
    snakemake.input.ranking,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.size,
    snakemake.output[0],
    snakemake.params.emulate,
    coactivation_path=snakemake.input.get("coactivation"),
    allocation_path=snakemake.input.get("allocation"),
)
