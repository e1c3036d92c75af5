"""Rule simulate: replay the captured router trace under one policy (moesub.simulate)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

from moesub.simulate import run_simulate

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

run_simulate(
    snakemake.input.router,
    snakemake.input.initial_sets,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.fraction,
    snakemake.input.cost,
    snakemake.output[0],
)
