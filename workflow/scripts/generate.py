"""Rule generate: greedy generation for one task under one policy (moesub.generate)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

import torch

from moesub.generate import run_generate

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)
torch.set_num_threads(snakemake.threads)

run_generate(
    snakemake.params.model_dir,
    snakemake.wildcards.task,
    snakemake.params.data_path,
    snakemake.input.initial_sets,
    snakemake.wildcards.policy,
    snakemake.params.policy,
    snakemake.params.fraction,
    snakemake.output[0],
    snakemake.params.generate,
)
