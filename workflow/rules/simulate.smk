# Stage 3 (simulate): replay the captured router logits through the C++ policy core, one
# (policy, fraction) per job, priced by the cost model calibrated on the engine.


rule cost_model:
    input:
        calibration=cost_calibration,
    output:
        "results/{model}/cost.json",
    log:
        "logs/{model}/cost_model.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        overrides=section("cost"),
    script:
        "../scripts/cost_model.py"


rule simulate:
    input:
        router="results/{model}/capture/eval_router.parquet",
        initial_sets="results/{model}/initial_sets.parquet",
        cost="results/{model}/cost.json",
    output:
        "results/{model}/simulate/{policy}/f{fraction}.parquet",
    log:
        "logs/{model}/simulate/{policy}_f{fraction}.log",
    benchmark:
        "results/benchmarks/{model}/simulate/{policy}_f{fraction}.tsv"
    conda:
        "../../envs/cpu.yaml"
    params:
        policy=policy_params,
        fraction=lambda wildcards: float(wildcards.fraction),
        core=core_build_id,
    script:
        "../scripts/simulate.py"
