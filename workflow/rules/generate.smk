# Stage 6 (generate): greedy generation (GSM8K, HumanEval, held-out code completion, free
# continuation) under each policy, on the offloading engine by default (generate.backend): rows
# carry time per token; the continuation decodes in batches on the emulator (no timing).


rule generate:
    input:
        unpack(allocation_input),
        model=model_input,
        ranking="results/{model}/expert_ranking.parquet",
        data=task_data,
        source=streams_source,
        reference=generate_reference,
    output:
        "results/{model}/generate/{task}/{policy}/{size}.parquet",
    log:
        "logs/{model}/generate/{task}/{policy}_{size}.log",
    benchmark:
        "results/benchmarks/{model}/generate/{task}/{policy}_{size}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        data_path=task_path,
        policy=policy_params,
        size=size_params,
        core=core_build_id,
        generate=generate_params,
        engine=engine_params,
    script:
        "../scripts/generate.py"
