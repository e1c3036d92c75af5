"""Rule analysis: statistics over every artefact (moesub.stats.run_analysis)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

from moesub.stats import run_analysis

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

inputs = {kind: list(paths) for kind, paths in snakemake.input.items()}
run_analysis(inputs, snakemake.params.analysis, snakemake.output[0])
