"""Rule regime: the model's cache regime per MoE layer, its skew and the pinned designs on
both traces (moesub.regime.run_regime)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.regime import run_regime

job_setup(snakemake.log[0])

run_regime(
    snakemake.input.router,
    snakemake.input.calib_router,
    snakemake.input.initial_sets,
    snakemake.params.fraction,
    snakemake.output.table,
    snakemake.output.summary,
    snakemake.output.designs,
    fractions=snakemake.params.fractions,
    policies=snakemake.params.policies,
)
