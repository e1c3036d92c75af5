"""Rule engine_bench: the engine at real expert sizes, synthetic routing (moesub.engine)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

import torch

from moesub.engine.bench import run_benchmark

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)
torch.set_num_threads(snakemake.threads)

run_benchmark(snakemake.params.bench, snakemake.wildcards.device, snakemake.output[0])
