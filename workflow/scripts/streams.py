"""Rule streams: evaluation and calibration token streams (moesub.streams.build_streams)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

from moesub.streams import build_streams

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

build_streams(
    snakemake.params.model_dir,
    snakemake.params.source,
    snakemake.params.streams,
    snakemake.output.eval,
    snakemake.output.calib,
)
