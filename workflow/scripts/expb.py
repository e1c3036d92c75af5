"""Rule expb: Experiment B, one condition at one target mass (moesub.expb.run_expb)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

import torch

from moesub.expb import run_expb

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)
torch.set_num_threads(snakemake.threads)

run_expb(
    snakemake.params.model_dir,
    snakemake.input.tokens,
    snakemake.input.initial_sets,
    snakemake.wildcards.condition,
    snakemake.params.target_mass,
    snakemake.output[0],
    snakemake.params.expb,
)
