# Stage 3b (price): each hardware profile as the model sees it, and every simulated policy's
# per-token-layer counts priced under it (moesub.price; this_machine also prices the engine
# runs' own counts). A profile change reruns its two jobs, never a replay.


rule hardware_profile:
    input:
        unpack(profile_inputs),
    output:
        "results/{model}/hardware/{hardware}.json",
    log:
        "logs/{model}/hardware/{hardware}.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        spec=profile_params,
        model_bytes=model_bytes_params,
    script:
        "../scripts/hardware_profile.py"


rule price:
    input:
        unpack(price_inputs),
    output:
        "results/{model}/priced/{hardware}.parquet",
    log:
        "logs/{model}/priced/{hardware}.log",
    benchmark:
        "results/benchmarks/{model}/priced/{hardware}.tsv"
    conda:
        "../../envs/cpu.yaml"
    params:
        core=core_build_id,
    script:
        "../scripts/price.py"
