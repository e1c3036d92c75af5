# Stage 2 (capture): the exact model over the streams -> token table + router-logit table;
# the expert ranking (per layer every expert by its calibration selections) whose prefixes are
# every cache's initial experts.


rule capture:
    input:
        model=model_input,
        streams="results/{model}/streams/{split}.parquet",
    output:
        tokens="results/{model}/capture/{split}_tokens.parquet",
        router="results/{model}/capture/{split}_router.parquet",
    log:
        "logs/{model}/capture_{split}.log",
    benchmark:
        "results/benchmarks/{model}/capture_{split}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        capture=stage_params("capture"),
    script:
        "../scripts/capture.py"


rule expert_ranking:
    input:
        "results/{model}/capture/calib_router.parquet",
    output:
        "results/{model}/expert_ranking.parquet",
    log:
        "logs/{model}/expert_ranking.log",
    conda:
        "../../envs/cpu.yaml"
    script:
        "../scripts/expert_ranking.py"
