"""Rule calibrate: measure the cost-model parameters on this machine (moesub.engine)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

import torch

from moesub.engine.calibrate import calibrate

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)
torch.set_num_threads(snakemake.threads)

calibrate(
    snakemake.params.model_dir,
    snakemake.wildcards.device,
    snakemake.output[0],
    snakemake.params.engine,
)
