# Stage 4 (emulate): recompute the model exactly under each policy (quality is exact).


rule emulate:
    input:
        unpack(coactivation_input),
        unpack(allocation_input),
        model=model_input,
        tokens="results/{model}/capture/eval_tokens.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        "results/{model}/emulate/{policy}/{size}.parquet",
    log:
        "logs/{model}/emulate/{policy}_{size}.log",
    benchmark:
        "results/benchmarks/{model}/emulate/{policy}_{size}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        policy=policy_params,
        size=size_params,
        core=core_build_id,
        emulate=stage_params("emulate", exclude=["policies", "sizes"]),
    script:
        "../scripts/emulate.py"
