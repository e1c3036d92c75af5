"""Rule report: results/report.html (moesub.report.render_report)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.report import render_report

job_setup(snakemake.log[0])

inputs = {kind: list(paths) for kind, paths in snakemake.input.items() if kind != "analysis"}
render_report(
    snakemake.input.analysis,
    inputs,
    snakemake.params.report,
    snakemake.output.html,
    fig_dir=snakemake.output.figures,
)
