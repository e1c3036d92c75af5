# Stage 6 (generate): greedy generation (GSM8K, HumanEval, held-out code completion, free
# continuation) under each policy, on the offloading engine by default (generate.backend): rows
# carry time per token; the continuation decodes in batches on the emulator (no timing).


rule generate:
    input:
        model=model_input,
        initial_sets="results/{model}/initial_sets.parquet",
        data=task_data,
        source=streams_source,
        reference=generate_reference,
    output:
        "results/{model}/generate/{task}/{policy}/f{fraction}.parquet",
    log:
        "logs/{model}/generate/{task}/{policy}_f{fraction}.log",
    benchmark:
        "results/benchmarks/{model}/generate/{task}/{policy}_f{fraction}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        data_path=task_path,
        policy=policy_params,
        fraction=lambda wildcards: float(wildcards.fraction),
        core=core_build_id,
        generate=generate_params,
        engine=engine_params,
    script:
        "../scripts/generate.py"
