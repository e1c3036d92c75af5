"""Rule export_trace: a captured router table as RTRACE01 or MBLT (moesub.traces.models)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.traces.models import export_trace

job_setup(snakemake.log[0])

export_trace(snakemake.input[0], {snakemake.wildcards.fmt: snakemake.output[0]})
