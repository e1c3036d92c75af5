"""`results/report.html`: one self-contained HTML file from the analysis outputs.

`render_report(analysis_dir, params, out_html, recommendations=...)` reads only what the
analysis rule wrote (`analysis.json` and the Parquet tables it names, through DuckDB) and the
recommend stage's documents (the page opens with them), draws the seaborn figures
(Agg backend), writes each as a PNG under `<out_html's folder>/figures/` (for Snakemake's
`report()` tags), embeds the same bytes as base64 in the page and renders
`templates/report.html.j2` (Jinja2, autoescaped). No external CSS, JS, fonts or images: the file
opens offline. A part whose data is missing shows one message saying why.

Modules: `load` (the analysis outputs, tolerant of absent tables and columns), `labels`
(non-overlapping point labels), `figures`, `tables` (the table type, number formats, the policy,
mass, generation and model tables), `experiments` (Experiment B, admission tables), `regime`
(the regime section: regime, skew and design tables), `headline` (the headline sentences),
`render` (the entry point).
"""

from moesub.report.figures import FIGURES
from moesub.report.render import render_report

__all__ = ["FIGURES", "render_report"]
