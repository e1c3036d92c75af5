# Experiment B: forced substitution at equal target mass per token-layer, heavy vs light, in two
# designs (study, matched); the matched design's feasibility on the calibration capture first.


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
