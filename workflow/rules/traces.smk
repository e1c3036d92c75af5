# Router traces in and out (moesub.traces.models, docs/traces.md): a captured model's router
# table written as RTRACE01 / MBLT (on request: no default target asks for them), and a model
# given as a trace imported into the capture artefacts simulate, regime and the recommendation
# read (its streams cut and split as the model's settings say).


rule export_trace:
    input:
        "results/{model}/capture/{split}_router.parquet",
    output:
        "results/{model}/capture/{split}.{fmt}",
    log:
        "logs/{model}/export_{split}_{fmt}.log",
    wildcard_constraints:
        model=alternation(CAPTURED_MODELS),
        fmt="rtrace01|mblt",
    conda:
        "../../envs/cpu.yaml"
    script:
        "../scripts/export_trace.py"


rule import_trace:
    input:
        unpack(trace_files),
    output:
        calib="results/{model}/capture/calib_router.parquet",
        eval="results/{model}/capture/eval_router.parquet",
        summary="results/{model}/trace.json",
    log:
        "logs/{model}/import_trace.log",
    wildcard_constraints:
        model=alternation(TRACE_MODELS),
    conda:
        "../../envs/cpu.yaml"
    params:
        trace=trace_params,
    script:
        "../scripts/import_trace.py"
