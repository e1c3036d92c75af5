"""Rule recommend: results/{model}/recommendation.json (moesub.recommend.write_recommendation)."""

# ruff: noqa: F821  (`snakemake` is injected by Snakemake)
from moesub.logs import job_setup
from moesub.recommend import INPUTS, write_recommendation

job_setup(snakemake.log[0])

write_recommendation(
    {k: getattr(snakemake.input, k) for k in INPUTS}
    | {"study_profile": snakemake.input.get("study_profile")},
    snakemake.wildcards.model,
    snakemake.params.recommend,
    snakemake.output[0],
)
