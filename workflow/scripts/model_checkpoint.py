"""Rule model_checkpoint: validate a local checkpoint and record its MoE geometry and the weights
its layers hold besides the routed experts (the profiles price them)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging

from moesub.io import write_json
from moesub.logs import job_setup
from moesub.models import check_checkpoint

job_setup(snakemake.log[0])

info = check_checkpoint(snakemake.params.path, tokenizer=True)  # streams tokenize with it
logging.info("checkpoint %s: %s", snakemake.params.path, info)
write_json({"path": snakemake.params.path, **info.to_dict()}, snakemake.output[0])
