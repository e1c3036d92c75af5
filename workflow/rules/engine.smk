# Stage 5 (engine): the real offloading engine. One job per model and device: the calibration
# (this machine's hardware profile, fitted to timed engine runs on the calibration streams) and
# every policy's runs on the model's evaluation streams, interleaved in rounds so that the
# machine's drift falls on all alike; and the real-expert-size benchmark (replaying a captured
# router trace, engine.bench.trace_model's, or synthetic routing). profiles/slurm sends these
# jobs to the GPU partition.


rule engine:
    input:
        engine_allocation_files,
        model=model_input,
        tokens="results/{model}/capture/eval_tokens.parquet",
        calib_tokens="results/{model}/capture/calib_tokens.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        calibration="results/{model}/engine/{device}/calibration.json",
        runs=[
            f"results/{{model}}/engine/{{device}}/{policy}/{size}.parquet"
            for policy, size in ENGINE_RUNS
        ],
    log:
        "logs/{model}/engine/{device}.log",
    benchmark:
        "results/benchmarks/{model}/engine/{device}.tsv"
    conda:
        engine_env
    threads: ALL_CORES
    params:
        model_dir=model_dir,
        engine=engine_params,
        calibration_size=regime_params,  # the regime's size (nearest a quarter of E)
        runs=engine_run_params,
        core=core_build_id,
    script:
        "../scripts/engine.py"


rule engine_bench:
    input:
        unpack(bench_inputs),
    output:
        table="results/engine_bench/{device}.parquet",
        token_layers="results/engine_bench/{device}_token_layers.parquet",
    log:
        "logs/engine_bench/{device}.log",
    benchmark:
        "results/benchmarks/engine_bench/{device}.tsv"
    conda:
        engine_env
    threads: ALL_CORES
    params:
        bench=bench_params,
        core=core_build_id,
    script:
        "../scripts/engine_bench.py"
