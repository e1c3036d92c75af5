"""Rule report: results/report.html from the analysis outputs, the recommendations and the
plans (moesub.report.render_report)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import os

from moesub.logs import job_setup
from moesub.report import render_report

job_setup(snakemake.log[0])

# the analysis rule's outputs, all in one folder
analysis_dir = os.path.commonpath([os.path.abspath(p) for p in snakemake.input.analysis])
if os.path.isfile(analysis_dir):
    analysis_dir = os.path.dirname(analysis_dir)
render_report(
    analysis_dir,
    snakemake.params.report,
    snakemake.output.html,
    fig_dir=snakemake.output.figures,
    recommendations=list(snakemake.input.recommendations),
    plans=list(snakemake.input.plans),
)
