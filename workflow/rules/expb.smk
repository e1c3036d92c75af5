# Experiment B: forced substitution at equal target mass, heavy vs light composition.


rule expb:
    input:
        model=model_input,
        tokens="results/{model}/capture/eval_tokens.parquet",
        initial_sets="results/{model}/initial_sets.parquet",
    output:
        "results/{model}/expb/{condition}/m{mass}.parquet",
    log:
        "logs/{model}/expb/{condition}_m{mass}.log",
    benchmark:
        "results/benchmarks/{model}/expb/{condition}_m{mass}.tsv"
    conda:
        "../../envs/cpu.yaml"
    threads: 1
    params:
        model_dir=model_dir,
        target_mass=lambda wildcards: float(wildcards.mass),
        core=core_build_id,
        expb=section("expb", exclude=EXPB_ANALYSIS_KEYS),
    script:
        "../scripts/expb.py"
