"""Rule engine_bench: the engine at real expert sizes, captured or synthetic routing
(moesub.engine.bench)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.engine.bench import run_benchmark
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_benchmark(
    snakemake.params.bench,
    snakemake.wildcards.device,
    snakemake.output.table,
    snakemake.output.token_layers,
)
