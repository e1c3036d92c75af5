"""Rule expert_ranking: per layer every expert ranked by its calibration selections
(moesub.capture)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.capture import run_expert_ranking
from moesub.logs import job_setup

job_setup(snakemake.log[0])

run_expert_ranking(snakemake.input[0], snakemake.output[0])
