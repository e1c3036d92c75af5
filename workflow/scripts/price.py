"""Rule price: the simulated (and engine) per-token-layer counts priced under one hardware
profile (moesub.price)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.price import run_price

job_setup(snakemake.log[0])

run_price(
    snakemake.input.profile,
    snakemake.input.simulate_counts,
    snakemake.input.get("engine", []),
    snakemake.output[0],
)
