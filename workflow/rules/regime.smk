# The model's cache regime (moesub.regime): fetch_every_miss and Belady hit rates, effective
# experts, routing entropy, gate weight by rank and reuse distances per MoE layer, at one cache
# size (regime.size, else the configured size nearest the reference study's 25% resident),
# beside the study's figures, with a one-line verdict.


rule regime:
    input:
        router="results/{model}/capture/eval_router.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        table="results/{model}/regime.parquet",
        summary="results/{model}/regime.json",
    log:
        "logs/{model}/regime.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        size=regime_params,
    script:
        "../scripts/regime.py"
