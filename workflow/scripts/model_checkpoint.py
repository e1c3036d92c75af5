"""Rule model_checkpoint: validate a local checkpoint and record its MoE geometry."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

from moesub.io import write_json
from moesub.models import check_checkpoint

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

info = check_checkpoint(snakemake.params.path)
logging.info("checkpoint %s: %s", snakemake.params.path, info)
write_json({"path": snakemake.params.path, **info.to_dict()}, snakemake.output[0])
