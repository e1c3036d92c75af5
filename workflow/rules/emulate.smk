# Stage 4 (emulate): recompute the model exactly under each policy (quality is exact).


rule emulate:
    input:
        unpack(coactivation_input),
        model=model_input,
        tokens="results/{model}/capture/eval_tokens.parquet",
        initial_sets="results/{model}/initial_sets.parquet",
    output:
        "results/{model}/emulate/{policy}/f{fraction}.parquet",
    log:
        "logs/{model}/emulate/{policy}_f{fraction}.log",
    benchmark:
        "results/benchmarks/{model}/emulate/{policy}_f{fraction}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        policy=policy_params,
        fraction=lambda wildcards: float(wildcards.fraction),
        core=core_build_id,
        emulate=stage_params("emulate", exclude=["policies"]),
    script:
        "../scripts/emulate.py"
