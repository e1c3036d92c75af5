"""Rule capture: the exact model over one stream split (moesub.capture.run_capture)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.capture import run_capture
from moesub.logs import job_setup

job_setup(snakemake.log[0], snakemake.threads)

run_capture(
    snakemake.params.model_dir,
    snakemake.input.streams,
    snakemake.output.tokens,
    snakemake.output.router,
    snakemake.params.capture,
)
