# Planned per-layer slot counts (moesub.allocation): for each policy with allocation: planned and
# each cache size, the split of L x C slots that maximizes the policy's hits on the calibration
# capture (never the evaluation streams); an input of that policy's jobs only.


rule allocation:
    input:
        unpack(coactivation_input),
        router="results/{model}/capture/calib_router.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        "results/{model}/allocation/{policy}/{size}.json",
    log:
        "logs/{model}/allocation/{policy}_{size}.log",
    benchmark:
        "results/benchmarks/{model}/allocation/{policy}_{size}.tsv"
    wildcard_constraints:
        policy=alternation(PLANNED_POLICIES),
    conda:
        "../../envs/cpu.yaml"
    params:
        policy=policy_params,
        size=size_params,
        core=core_build_id,
    script:
        "../scripts/allocation.py"
