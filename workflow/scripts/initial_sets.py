"""Rule initial_sets: frequency-initial resident sets per cache fraction (moesub.capture)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

from moesub.capture import write_initial_sets

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

write_initial_sets(snakemake.input[0], snakemake.params.fractions, snakemake.output[0])
