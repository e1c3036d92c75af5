# Stage 2 (capture): the exact model over the streams -> token table + router-logit table;
# frequency-initial resident sets from the calibration capture.


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


rule initial_sets:
    input:
        "results/{model}/capture/calib_router.parquet",
    output:
        "results/{model}/initial_sets.parquet",
    log:
        "logs/{model}/initial_sets.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        fractions=INITIAL_SET_FRACTIONS,
    script:
        "../scripts/initial_sets.py"
