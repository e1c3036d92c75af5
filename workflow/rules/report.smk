# Stage 8 (report): results/report.html, self-contained.


rule report:
    input:
        **analysis_inputs(),
        analysis="results/analysis",
    output:
        html="results/report.html",
        figures=directory("results/figures"),
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
