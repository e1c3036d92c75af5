# Stage 7b (recommend): per model and cache fraction, the fastest policy within the Δppl budget
# and the fastest lossless one (moesub.recommend), from the analysis outputs; the report opens
# with it.


rule recommend:
    input:
        analysis=rules.analysis.output.json,
        summary=rules.analysis.output.summary,
        speed_quality=rules.analysis.output.speed_quality,
        per_input_points=rules.analysis.output.per_input_points,
        models=rules.analysis.output.models,
        priced=rules.analysis.output.priced,
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
