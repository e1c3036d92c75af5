"""Rule regime: the model's cache regime per MoE layer, its skew and the pinning and allocation
designs on both traces (moesub.regime.run_regime)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.regime import run_regime

job_setup(snakemake.log[0])

run_regime(
    snakemake.input.router,
    snakemake.input.calib_router,
    snakemake.input.ranking,
    snakemake.params.size,
    snakemake.output.table,
    snakemake.output.summary,
    snakemake.output.designs,
    sizes=snakemake.params.sizes,
    policies=snakemake.params.policies,
    allocations=snakemake.params.allocations,
)
