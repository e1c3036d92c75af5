"""Rule cost_model: the engine's calibration with config.yaml `cost:` overrides applied."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys
from dataclasses import asdict, replace

from moesub.io import write_json
from moesub.simulate import CostModel

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

cost = replace(CostModel.from_json(snakemake.input.calibration), **snakemake.params.overrides)
logging.info("cost model: %s", cost)
write_json(asdict(cost), snakemake.output[0])
