"""Rule import_trace: a trace model's file(s) -> its calibration and evaluation router tables
and its summary (moesub.traces.models)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.traces.models import import_trace

job_setup(snakemake.log[0])

import_trace(
    snakemake.wildcards.model,
    snakemake.params.trace["spec"],
    snakemake.output.calib,
    snakemake.output.eval,
    snakemake.output.summary,
    skipped_policies=snakemake.params.trace["skipped_policies"],
    skipped_stages=snakemake.params.trace["skipped_stages"],
    skipped_hardware=snakemake.params.trace["skipped_hardware"],
)
