"""Rule plan: results/{model}/plan/{hardware}/{size}.json and its pin list (moesub.plan)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.plan import run_plan

job_setup(snakemake.log[0])

run_plan(
    snakemake.input.recommendation,
    snakemake.wildcards.model,
    snakemake.wildcards.hardware,
    snakemake.params.size,
    snakemake.params.model_dir,
    snakemake.input.router,
    snakemake.input.ranking,
    snakemake.output.plan,
)
