# Stage 8 (report): results/report.html, self-contained, from the analysis outputs and the
# recommendations only (it opens with the recommendations).


rule report:
    input:
        analysis=rules.analysis.output,
        recommendations=expand(rules.recommend.output[0], model=MODELS),
    output:
        html="results/report.html",
        figures=report(
            directory("results/figures"),
            patterns=["{name}.png"],
            category="Figures",
            caption="../report/figures.rst",
        ),
    log:
        "logs/report.log",
    benchmark:
        "results/benchmarks/report.tsv"
    conda:
        "../../envs/cpu.yaml"
    params:
        report=report_params(),
    script:
        "../scripts/report.py"
