# Stage 7 (analysis): DuckDB + scipy statistics over every Parquet artefact.


rule analysis:
    input:
        **analysis_inputs(),
    output:
        directory("results/analysis"),
    log:
        "logs/analysis.log",
    benchmark:
        "results/benchmarks/analysis.tsv"
    conda:
        "../../envs/cpu.yaml"
    params:
        analysis=analysis_params(),
    script:
        "../scripts/analysis.py"
