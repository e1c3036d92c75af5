"""Rule report: results/report.html (moesub.report.render_report)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
import logging
import sys

from moesub.report import render_report

sys.stdout = sys.stderr = open(snakemake.log[0], "w", buffering=1)  # noqa: SIM115
logging.basicConfig(
    stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
)

inputs = {kind: list(paths) for kind, paths in snakemake.input.items() if kind != "analysis"}
render_report(
    snakemake.input.analysis,
    inputs,
    snakemake.params.report,
    snakemake.output.html,
    fig_dir=snakemake.output.figures,
)
