# Stage 7b (recommend): per model, hardware and cache size, the fastest policy within the Δppl
# budget (screened on one half of the evaluation streams, reported on the other) and the fastest
# lossless one (moesub.recommend), from the analysis outputs; the report opens with it.
from moesub.recommend import INPUTS as RECOMMEND_INPUTS


rule recommend:
    input:
        **{
            k: getattr(rules.analysis.output, k)
            for k in RECOMMEND_INPUTS
            if k != "analysis"
        },
        **study_profile_input(),
        analysis=rules.analysis.output.json,
    output:
        "results/{model}/recommendation.json",
    log:
        "logs/{model}/recommend.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        recommend=config["recommend"],
    script:
        "../scripts/recommend.py"
