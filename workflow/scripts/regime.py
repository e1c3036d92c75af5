"""Rule regime: the model's cache regime per MoE layer (moesub.regime.run_regime)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.regime import run_regime

job_setup(snakemake.log[0])

run_regime(
    snakemake.input.router,
    snakemake.input.ranking,
    snakemake.params.size,
    snakemake.output.table,
    snakemake.output.summary,
)
