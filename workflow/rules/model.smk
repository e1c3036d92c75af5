# Stage 1 (model): build the embedded default model, or check a local checkpoint.


rule model_embedded:
    output:
        config="results/{model}/model/config.json",
        weights="results/{model}/model/model.safetensors",
        summary="results/{model}/model/train_summary.json",
    log:
        "logs/{model}/model.log",
    benchmark:
        "results/benchmarks/{model}/model.tsv"
    wildcard_constraints:
        model=alternation(EMBEDDED_MODELS),
    conda:
        "../../envs/cpu.yaml"
    threads: config["embedded"]["threads"] or ALL_CORES
    params:
        model_dir=model_dir,
        embedded=section("embedded"),
    script:
        "../scripts/model_embedded.py"


rule model_checkpoint:
    input:
        checkpoint_config,
    output:
        "results/{model}/checkpoint.json",
    log:
        "logs/{model}/checkpoint.log",
    wildcard_constraints:
        model=alternation(CHECKPOINT_MODELS),
    conda:
        "../../envs/cpu.yaml"
    params:
        path=model_dir,
    script:
        "../scripts/model_checkpoint.py"
