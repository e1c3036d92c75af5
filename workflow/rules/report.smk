# Stage 8 (report): results/report.html, self-contained, from the analysis outputs, the
# recommendations (it opens with them) and the plans that carry them to a runtime.


rule report:
    input:
        analysis=rules.analysis.output,
        recommendations=expand(rules.recommend.output[0], model=MODELS),
        plans=plans(),
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
