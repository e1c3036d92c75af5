# Experiment B: forced substitution at equal target mass per token-layer, heavy vs light, in two
# designs (study, matched); the matched design's feasibility on the calibration capture first.
# The factorial design (rank bucket x weight band) plans on the calibration capture first too,
# then runs one job per cell.


rule expb_feasibility:
    input:
        "results/{model}/capture/calib_router.parquet",
    output:
        "results/{model}/expb/feasibility.parquet",
    log:
        "logs/{model}/expb/feasibility.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        heavy_mass=EXPB_DESIGNS["matched"]["heavy_mass"],
        masses=EXPB_DESIGNS["matched"]["masses"],
    script:
        "../scripts/expb_feasibility.py"


rule expb:
    input:
        unpack(expb_inputs),
    output:
        "results/{model}/expb/{design}/{condition}/m{mass}.parquet",
    log:
        "logs/{model}/expb/{design}/{condition}_m{mass}.log",
    benchmark:
        "results/benchmarks/{model}/expb/{design}_{condition}_m{mass}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        target_mass=lambda wildcards: float(wildcards.mass),
        core=core_build_id,
        expb=expb_params,
    script:
        "../scripts/expb.py"


rule expb_factorial_feasibility:
    input:
        "results/{model}/capture/calib_router.parquet",
    output:
        "results/{model}/expb/factorial_feasibility.parquet",
    log:
        "logs/{model}/expb/factorial_feasibility.log",
    conda:
        "../../envs/cpu.yaml"
    params:
        spec=expb_factorial_spec(),
        seed=config["expb"]["seed"],
    script:
        "../scripts/expb_factorial_feasibility.py"


rule expb_factorial:
    input:
        model=model_input,
        tokens="results/{model}/capture/eval_tokens.parquet",
        ranking="results/{model}/expert_ranking.parquet",
        router="results/{model}/capture/eval_router.parquet",
        feasibility="results/{model}/expb/factorial_feasibility.parquet",
    output:
        "results/{model}/expb/factorial/{cell}.parquet",
    log:
        "logs/{model}/expb/factorial_{cell}.log",
    benchmark:
        "results/benchmarks/{model}/expb/factorial_{cell}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        spec=expb_factorial_spec(),
        core=core_build_id,
        expb=expb_factorial_params,
    script:
        "../scripts/expb_factorial.py"
