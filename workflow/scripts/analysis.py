"""Rule analysis: statistics over every artefact (moesub.stats.run_analysis) into the rule's
named outputs (results/analysis/analysis.json and one Parquet file per table)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from pathlib import Path

from moesub.logs import job_setup
from moesub.stats import run_analysis

job_setup(snakemake.log[0])

inputs = {kind: list(paths) for kind, paths in snakemake.input.items()}
run_analysis(inputs, snakemake.params.analysis, Path(snakemake.output.json).parent)
