# Stage 3 (simulate): replay the captured router logits through the C++ policy core, one
# (policy, fraction) per job: the replay table and its per-token-layer counts (priced per
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
        router="results/{model}/capture/eval_router.parquet",
        initial_sets="results/{model}/initial_sets.parquet",
    output:
        table="results/{model}/simulate/{policy}/f{fraction}.parquet",
        counts="results/{model}/simulate/{policy}/f{fraction}.counts.parquet",
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
