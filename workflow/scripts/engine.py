"""Rule engine: the real offloading engine under one policy (moesub.engine.run_engine)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

import torch

from moesub.engine.decode import run_engine

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)
torch.set_num_threads(snakemake.threads)

run_engine(
    snakemake.params.model_dir,
    snakemake.input.tokens,
    snakemake.input.initial_sets,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.fraction,
    snakemake.wildcards.device,
    snakemake.output[0],
    snakemake.params.engine,
)
