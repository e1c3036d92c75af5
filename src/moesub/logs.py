"""Set-up shared by every Snakemake job script: output to the rule's log, threads as scheduled."""

from __future__ import annotations

import logging
import sys


def job_setup(log_path: str, threads: int | None = None) -> None:
    """Send stdout, stderr and logging to `log_path`; give torch the job's `threads`."""
    sys.stdout = sys.stderr = open(log_path, "w", buffering=1)  # noqa: SIM115 (for the job's life)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    if threads is not None:
        import torch

        # torch's default (every core) oversubscribes when Snakemake runs jobs side by side
        torch.set_num_threads(threads)
