# The model's cache regime (moesub.regime): fetch_every_miss and Belady hit rates, effective
# experts, routing entropy, gate weight by rank and reuse distances per MoE layer, at the
# reference study's 25% resident, beside the study's figures, with a one-line verdict; the
# static skew beside the real reference model's, and the simulated policies with pins replayed
# on the evaluation trace and on its skew-matched twin (simulate only: seconds).

from moesub.regime.designs import designs_of


rule regime:
    input:
        router="results/{model}/capture/eval_router.parquet",
        calib_router="results/{model}/capture/calib_router.parquet",
        initial_sets="results/{model}/initial_sets.parquet",
    output:
        table="results/{model}/regime.parquet",
        summary="results/{model}/regime.json",
        designs="results/{model}/regime_designs.parquet",
    log:
        "logs/{model}/regime.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        fraction=REGIME_FRACTION,
        fractions=config["fractions"],
        # the designs only: a change to another policy does not rerun the regime
        policies=designs_of({name: policy_dict(name) for name in SIMULATE_POLICIES}),
    script:
        "../scripts/regime.py"
