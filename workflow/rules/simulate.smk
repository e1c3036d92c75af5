# Stage 3 (simulate): replay the captured router logits through the C++ policy core, one
# (policy, cache size) per job: the replay table and its per-token-layer counts (priced per
# hardware profile by the price rules, workflow/rules/price.smk); the co-activation table
# (calibration split) for policies with substitute_by: coactivation.


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
    output:
        table="results/{model}/simulate/{policy}/{size}.parquet",
        counts="results/{model}/simulate/{policy}/{size}.counts.parquet",
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
