# Stage 7c (plan): per model, hardware and cache size, what a runtime loads (moesub.plan): the
# recommended policy, per-layer slots, initial and pinned experts, the predicted figures
# (results/{model}/plan/{hardware}/{size}.json) and the pin list beside it ({size}.pins.txt).


rule plan:
    input:
        recommendation=rules.recommend.output[0],
        model=model_input,
        router="results/{model}/capture/calib_router.parquet",
        ranking="results/{model}/expert_ranking.parquet",
    output:
        plan="results/{model}/plan/{hardware}/{size}.json",
        pins="results/{model}/plan/{hardware}/{size}.pins.txt",
    log:
        "logs/{model}/plan/{hardware}/{size}.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        model_dir=model_dir,
        size=size_params,
    script:
        "../scripts/plan.py"
