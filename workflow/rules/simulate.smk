# Stage 3 (simulate): replay the captured router logits through the C++ policy core, one
# (policy, cache size) per job, priced by the cost model calibrated on the engine; the
# co-activation table (calibration split) for policies with substitute_by: coactivation.


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


rule coactivation:
    input:
        "results/{model}/capture/calib_router.parquet",
    output:
        "results/{model}/coactivation.npz",
    log:
        "logs/{model}/coactivation.log",
    benchmark:
        "results/benchmarks/{model}/coactivation.tsv"
    conda:
        "../../envs/cpu.yaml"
    params:
        core=core_build_id,
    script:
        "../scripts/coactivation.py"


rule simulate:
    input:
        unpack(coactivation_input),
        unpack(allocation_input),
        router="results/{model}/capture/eval_router.parquet",
        ranking="results/{model}/expert_ranking.parquet",
        cost="results/{model}/cost.json",
    output:
        "results/{model}/simulate/{policy}/{size}.parquet",
    log:
        "logs/{model}/simulate/{policy}_{size}.log",
    benchmark:
        "results/benchmarks/{model}/simulate/{policy}_{size}.tsv"
    conda:
        "../../envs/cpu.yaml"
    params:
        policy=policy_params,
        size=size_params,
        core=core_build_id,
    script:
        "../scripts/simulate.py"
