# Stage 7 (analysis): DuckDB + scipy statistics over every Parquet artefact. One named output
# per table (moesub.stats.OUTPUT_FILES: results/analysis/<name>.parquet) plus analysis.json;
# the report reads exactly these.
from moesub.stats import OUTPUT_FILES


rule analysis:
    input:
        **analysis_inputs(),
    output:
        **{name: f"results/analysis/{name}.parquet" for name in OUTPUT_FILES},
        json="results/analysis/analysis.json",
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
