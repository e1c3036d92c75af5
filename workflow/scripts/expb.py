"""Rule expb: Experiment B, one design, condition and target mass (moesub.expb.run_expb)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.expb import run_expb
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_expb(
    snakemake.params.model_dir,
    snakemake.input.tokens,
    snakemake.input.ranking,
    snakemake.wildcards.design,
    snakemake.wildcards.condition,
    snakemake.params.target_mass,
    snakemake.output[0],
    snakemake.params.expb,
    router_path=snakemake.input.get("router"),
    feasibility_path=snakemake.input.get("feasibility"),
)
