"""Rule streams: evaluation and calibration token streams (moesub.streams.build_streams)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.streams import build_streams

job_setup(snakemake.log[0])

build_streams(
    snakemake.params.model_dir,
    snakemake.params.source,
    snakemake.params.streams,
    snakemake.output.eval,
    snakemake.output.calib,
)
