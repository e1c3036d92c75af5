# Stage 8 (report): results/report.html, self-contained, from the analysis outputs only.


rule report:
    input:
        rules.analysis.output,
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
