# The model's cache regime (moesub.regime): fetch_every_miss and Belady hit rates, effective
# experts, routing entropy, gate weight by rank and reuse distances per MoE layer, at one cache
# size (regime.size, else the configured size nearest the reference study's 25% resident),
# beside the study's figures, with a one-line verdict; the static skew beside the real reference
# model's, and the simulated policies with pins or planned slots replayed at every cache size on
# the evaluation trace and on its skew-matched twin (simulate only: seconds).


rule regime:
    input:
        router="results/{model}/capture/eval_router.parquet",
        calib_router="results/{model}/capture/calib_router.parquet",
        ranking="results/{model}/expert_ranking.parquet",
        allocations=regime_allocation_files,
    output:
        table="results/{model}/regime.parquet",
        summary="results/{model}/regime.json",
        designs="results/{model}/regime_designs.parquet",
    log:
        "logs/{model}/regime.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        size=regime_params,
        sizes=regime_sizes,
        policies=REGIME_DESIGNS,
        allocations=regime_allocations,
    script:
        "../scripts/regime.py"
