"""Rule capture: the exact model over one stream split (moesub.capture.run_capture)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

import torch

from moesub.capture import run_capture

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)
torch.set_num_threads(snakemake.threads)

run_capture(
    snakemake.params.model_dir,
    snakemake.input.streams,
    snakemake.output.tokens,
    snakemake.output.router,
    snakemake.params.capture,
)
