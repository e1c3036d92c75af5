# The model's cache regime (moesub.regime): fetch_every_miss and Belady hit rates, effective
# experts, routing entropy, gate weight by rank and reuse distances per MoE layer, at the
# reference study's 25% resident, beside the study's figures, with a one-line verdict.


rule regime:
    input:
        router="results/{model}/capture/eval_router.parquet",
        initial_sets="results/{model}/initial_sets.parquet",
    output:
        table="results/{model}/regime.parquet",
        summary="results/{model}/regime.json",
    log:
        "logs/{model}/regime.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        fraction=REGIME_FRACTION,
    script:
        "../scripts/regime.py"
