# Evaluation and calibration token streams.


rule streams:
    input:
        model=model_input,
        source=streams_source,
    output:
        eval="results/{model}/streams/eval.parquet",
        calib="results/{model}/streams/calib.parquet",
    log:
        "logs/{model}/streams.log",
    wildcard_constraints:
        model=alternation(CAPTURED_MODELS),
    conda:
        "../../envs/cpu.yaml"
    params:
        model_dir=model_dir,
        source=canonical(config["streams"]["source"]),
        streams=section("streams", exclude=["source"]),
    script:
        "../scripts/streams.py"
