# Stage 5 (engine): the real offloading engine. The calibration (this machine's hardware
# profile, fitted to timed engine runs on the calibration streams), per-policy runs on the
# model's evaluation streams, and the real-expert-size benchmark (replaying a captured router
# trace, engine.bench.trace_model's, or synthetic routing). profiles/slurm sends these
# jobs to the GPU partition.


rule calibrate:
    input:
        model=model_input,
        tokens="results/{model}/capture/calib_tokens.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        "results/{model}/engine/{device}/calibration.json",
    log:
        "logs/{model}/engine/{device}/calibrate.log",
    benchmark:
        "results/benchmarks/{model}/engine/{device}/calibrate.tsv"
    conda:
        engine_env
    threads: ALL_CORES
    params:
        model_dir=model_dir,
        engine=engine_params,
        size=regime_params,  # the regime's size (nearest a quarter of E)
        core=core_build_id,
    script:
        "../scripts/calibrate.py"


rule engine:
    input:
        unpack(allocation_input),
        model=model_input,
        tokens="results/{model}/capture/eval_tokens.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        "results/{model}/engine/{device}/{policy}/{size}.parquet",
    log:
        "logs/{model}/engine/{device}/{policy}_{size}.log",
    benchmark:
        "results/benchmarks/{model}/engine/{device}/{policy}_{size}.tsv"
    conda:
        engine_env
    threads: ALL_CORES
    params:
        model_dir=model_dir,
        policy=policy_params,
        size=size_params,
        core=core_build_id,
        engine=engine_params,
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
