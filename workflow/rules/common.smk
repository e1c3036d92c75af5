# Helpers shared by the stage files (functions and constants only, no rules).
#
# Everything below runs at parse time, after the schema validation in the Snakefile, so a bad
# config (unknown policy name in a stage's list, C < k, a checkpoint without config.json or
# tokenizer files) fails here, naming the key, before any job is scheduled or any file written.
#
# Invalidation: each rule's params carry only the settings that rule uses (one policy's dict,
# one config section), so editing a policy reruns only that policy's jobs plus analysis/report.

import os
import re

from moesub.config import (
    ALL_RESIDENT,
    ALL_RESIDENT_POLICY,
    FACTORIAL_CELLS,
    check_capacities,
    check_input_paths,
    check_pins,
    expand_policies,
    input_paths,
    canonical,
    is_planned,
    model_sizes,
    number_label,
    policy_spec,
    priced_hardware,
    pricing_bytes,
    profile_spec,
    regime_size,
    size_labels,
    stage_policies,
    stage_sizes,
)
from moesub.hardware import STUDY_PROFILE, THIS_MACHINE
from moesub.regime.designs import designs_of

# Threads of the jobs that should run alone on a local machine (training; the engine, whose
# timings other jobs would disturb): every core of this run (--cores). A cluster run has no
# --cores (None): there profiles/slurm sets these rules' threads (cpus per task) explicitly.
ALL_CORES = workflow.resource_settings.cores or 1

POLICIES = expand_policies(config)
GEOMETRY = check_capacities(config)  # model -> (E, k)
check_input_paths(config)
MODELS = list(config["models"])
EMBEDDED_MODELS = [m for m in MODELS if config["models"][m].get("embedded")]
# Models given as a router trace (moesub.traces.models): imported, then simulate, regime and the
# recommendation only; every other model is captured from its weights.
TRACE_MODELS = [m for m in MODELS if config["models"][m].get("trace")]
CAPTURED_MODELS = [m for m in MODELS if m not in TRACE_MODELS]
CHECKPOINT_MODELS = [m for m in CAPTURED_MODELS if m not in EMBEDDED_MODELS]
# Cache sizes: labels f<fraction> and b<budget> (the {size} wildcard), each resolved per model
# to C slots per layer (a budget through the model's pricing geometry and expert_bits).
SIZES = size_labels(config)
MODEL_SIZES = {m: model_sizes(config, m) for m in MODELS}  # model -> label -> CacheSize
STAGE_SIZES = stage_sizes(
    config
)  # simulate: every size; emulate, engine, generate: theirs
REGIME_SIZES = {m: regime_size(config, m) for m in MODELS}
check_pins(config, POLICIES)

STAGE_POLICIES = stage_policies(config, POLICIES)
SIMULATE_POLICIES = STAGE_POLICIES["simulate"]
# model -> the policies it simulates; a trace model's skipped ones -> why (the report says so)
MODEL_POLICIES = {m: SIMULATE_POLICIES for m in CAPTURED_MODELS}
TRACE_SKIPPED = {}
# Hardware profiles priced (hardware.price); this_machine is the calibration of the first device,
# so a trace model (no engine) is priced on the others (model -> its profiles; skipped -> why)
HARDWARE = priced_hardware(config)
MODEL_HARDWARE = {m: HARDWARE for m in CAPTURED_MODELS}
TRACE_SKIPPED_HARDWARE = {}
TRACE_SKIPPED_STAGES = (
    "emulate, the engine (and its calibration), Experiment B and generation run the model's "
    "weights, and a plan names its checkpoint; a trace model has its routing only"
)
if TRACE_MODELS:
    from moesub.traces.models import trace_geometry, trace_hardware, trace_policies
    from moesub.config import model_geometry

    for m in TRACE_MODELS:
        has_logits = trace_geometry(config, m, model_geometry).has_logits
        MODEL_POLICIES[m], TRACE_SKIPPED[m] = trace_policies(
            config, m, SIMULATE_POLICIES, POLICIES, has_logits
        )
        MODEL_HARDWARE[m], TRACE_SKIPPED_HARDWARE[m] = trace_hardware(m, HARDWARE)
EMULATE_POLICIES = STAGE_POLICIES["emulate"]
ENGINE_POLICIES = STAGE_POLICIES["engine"]
BENCH_POLICIES = STAGE_POLICIES["engine_bench"]  # None: the library's study set
# task -> the policies it runs (a task's own list, else generate's)
TASK_POLICIES = {
    task: STAGE_POLICIES.get(f"generate.tasks.{task}", STAGE_POLICIES["generate"])
    for task in config["generate"]["tasks"]
}
PLANNED_POLICIES = [name for name, spec in POLICIES.items() if is_planned(spec)]
ENGINE_DEVICES = config["engine"]["devices"]
# the engine job's runs (one job per model and device runs them all, interleaved)
ENGINE_RUNS = [(p, s) for p in ENGINE_POLICIES for s in STAGE_SIZES["engine"]]
TASKS = list(config["generate"]["tasks"])
# Experiment B: design -> its targets and decision rule (schema defaults filled in); the study
# and matched designs run at target masses, the factorial design runs cells.
EXPB_DESIGNS = {d: s for d, s in config["expb"]["designs"].items() if d != "factorial"}
EXPB_FACTORIAL = config["expb"]["designs"]["factorial"]
# Experiment B keys the expb jobs do not read (the designs' targets and decision rules, the level
# of the tests): changing a decision rule reruns only the analysis.
EXPB_ANALYSIS_KEYS = ["designs", "alpha"]
# the factorial design's keys its jobs do not read (whether it runs, its decision rule)
EXPB_FACTORIAL_ANALYSIS_KEYS = ["enabled", "max_weight_gap"]


def alternation(names):
    """Wildcard regex matching exactly these names (matches nothing for an empty list)."""
    return "|".join(re.escape(n) for n in names) if names else "(?!x)x"


def section(name, exclude=()):
    """A config section minus the keys the workflow itself consumes (policy lists, ...)."""
    return canonical({k: v for k, v in config[name].items() if k not in exclude})


def model_dir(wildcards):
    """The model's checkpoint directory: built by the pipeline, or the configured path."""
    spec = config["models"][wildcards.model]
    if spec.get("embedded"):
        return f"results/{wildcards.model}/model"
    return spec["path"]


def stage_params(name, exclude=()):
    """Params of a model-loading stage: `section(name, exclude)` plus, for a model placed by
    Accelerate, its `models.<model>.loading` as `loading` (changing the placement reruns the
    model's jobs; models without one keep their params, so their results stay valid)."""

    def params(wildcards):
        out = section(name, exclude)
        loading = config["models"][wildcards.model].get("loading") or {}
        if any(value is not None for value in loading.values()):
            out["loading"] = canonical(loading)
        return out

    return params


def model_artefact(name):
    """What a model-consuming job waits for: the built model's summary, the checkpoint check or
    a trace model's import summary."""
    if name in TRACE_MODELS:
        return f"results/{name}/trace.json"
    if config["models"][name].get("embedded"):
        return f"results/{name}/model/train_summary.json"
    return f"results/{name}/checkpoint.json"


def model_input(wildcards):
    return model_artefact(wildcards.model)


def checkpoint_config(wildcards):
    """A real checkpoint's config.json (its mtime reruns the check and everything downstream)."""
    return os.path.join(config["models"][wildcards.model]["path"], "config.json")


def config_inputs(prefix):
    """The local paths config names under `prefix` (moesub.config.input_paths): inputs of the
    rule that reads them, so that editing or touching one re-plans it and what depends on it.
    """
    return [path for key, path, _ in input_paths(config) if key.startswith(prefix)]


def streams_source(wildcards):
    return config_inputs("streams.source.")


def policy_dict(name):
    return canonical(
        policy_spec(ALL_RESIDENT_POLICY) if name == ALL_RESIDENT else POLICIES[name]
    )


def policy_params(wildcards):
    """Only this policy's settings: editing another policy leaves this job's params unchanged."""
    return policy_dict(wildcards.policy)


def core_build_id(wildcards):
    """Identity of the compiled policy core: rebuilding the core reruns the jobs that use it."""
    from moesub.policy import CORE_BUILD_ID

    return CORE_BUILD_ID


def size_params(wildcards):
    """The cache size resolved for this model (label, C, fraction; a budget's pricing)."""
    return canonical(MODEL_SIZES[wildcards.model][wildcards.size].to_dict())


def regime_params(wildcards):
    """The size the model's regime is measured at (moesub.config.regime_size)."""
    return canonical(REGIME_SIZES[wildcards.model].to_dict())


# The regime's designs (moesub.regime.designs): the simulated policies with pins or planned
# slots only, so a change to another policy does not rerun the regime; per model, since a trace
# model runs only the policies its trace can (MODEL_POLICIES).
REGIME_DESIGNS = {
    m: designs_of({name: policy_dict(name) for name in MODEL_POLICIES[m]})
    for m in MODELS
}


def regime_designs(wildcards):
    return REGIME_DESIGNS[wildcards.model]


def regime_sizes(wildcards):
    """Every cache size of the model, resolved (the regime's designs run at each)."""
    return [canonical(s.to_dict()) for s in MODEL_SIZES[wildcards.model].values()]


def regime_allocations(wildcards):
    """design -> size label -> the allocation artefact of each planned design at every size."""
    return {
        name: {
            size: f"results/{wildcards.model}/allocation/{name}/{size}.json"
            for size in MODEL_SIZES[wildcards.model]
        }
        for name, spec in REGIME_DESIGNS[wildcards.model].items()
        if is_planned(spec)
    }


def regime_allocation_files(wildcards):
    """The artefacts of `regime_allocations`: inputs of the regime job."""
    return [
        path
        for paths in regime_allocations(wildcards).values()
        for path in paths.values()
    ]


def allocation_path(model, policy, size):
    """A planned policy's per-layer slots at a size (None: the policy is not planned)."""
    if is_planned(POLICIES.get(policy, {})):
        return f"results/{model}/allocation/{policy}/{size}.json"
    return None


def allocation_input(wildcards):
    """A planned policy's per-layer slots at this size: an input of its jobs only."""
    path = allocation_path(wildcards.model, wildcards.policy, wildcards.size)
    return {"allocation": path} if path else {}


def engine_run_params(wildcards):
    """Per engine run, in the engine job's output order (`ENGINE_RUNS`): the policy's name, its
    settings, the resolved size and its allocation (None: uniform slots)."""
    return [
        [
            policy,
            policy_dict(policy),
            canonical(MODEL_SIZES[wildcards.model][size].to_dict()),
            allocation_path(wildcards.model, policy, size),
        ]
        for policy, size in ENGINE_RUNS
    ]


def engine_allocation_files(wildcards):
    """The planned engine runs' allocations: inputs of the engine job."""
    return [path for _, _, _, path in engine_run_params(wildcards) if path]


def coactivation_input(wildcards):
    """The model's co-activation table, an input only of policies that substitute by it."""
    if POLICIES.get(wildcards.policy, {}).get("substitute_by") == "coactivation":
        return {"coactivation": f"results/{wildcards.model}/coactivation.npz"}
    return {}


def trace_files(wildcards):
    """A trace model's trace file(s): an exported one is the export rule's output."""
    spec = config["models"][wildcards.model]
    return {k: spec[k] for k in ("trace", "calib_trace") if spec.get(k)}


def trace_params(wildcards):
    """A trace model's settings, its top-k resolved (an exported RTRACE01 takes its source
    model's), and the stages and policies it skips with the reasons."""
    m = wildcards.model
    spec = {k: v for k, v in config["models"][m].items() if k != "loading"}
    spec["top_k"] = spec.get("top_k") or GEOMETRY[m][1]
    return canonical(
        {
            "spec": spec,
            "skipped_policies": TRACE_SKIPPED[m],
            "skipped_stages": TRACE_SKIPPED_STAGES,
            "skipped_hardware": TRACE_SKIPPED_HARDWARE[m],
        }
    )


def profile_inputs(wildcards):
    """this_machine's profile comes from the calibration of the first engine device; the
    others price a checkpoint's dense weights from its check's record."""
    if wildcards.hardware == THIS_MACHINE:
        device = ENGINE_DEVICES[0]
        return {
            "calibration": f"results/{wildcards.model}/engine/{device}/calibration.json"
        }
    if wildcards.model in CHECKPOINT_MODELS:
        return {"checkpoint": model_artefact(wildcards.model)}
    return {}


def profile_params(wildcards):
    """A profile's keys (None for this_machine): editing one profile reruns its jobs only."""
    return canonical(profile_spec(config, wildcards.hardware))


def model_bytes_params(wildcards):
    """The bytes the model is priced at on the profiles that are not this machine's."""
    if wildcards.hardware == THIS_MACHINE:
        return None
    return canonical(pricing_bytes(config, wildcards.model))


def price_inputs(wildcards):
    """The profile, every policy the model simulates' counts and (this_machine) the first
    device's engine runs."""
    inputs = {
        "profile": f"results/{wildcards.model}/hardware/{wildcards.hardware}.json",
        "simulate_counts": expand(
            "results/{model}/simulate/{policy}/{size}.counts.parquet",
            model=wildcards.model,
            policy=MODEL_POLICIES[wildcards.model],
            size=STAGE_SIZES["simulate"],
        ),
    }
    if wildcards.hardware == THIS_MACHINE:
        inputs["engine"] = expand(
            "results/{model}/engine/{device}/{policy}/{size}.parquet",
            model=wildcards.model,
            device=ENGINE_DEVICES[:1],
            policy=ENGINE_POLICIES,
            size=STAGE_SIZES["engine"],
        )
    return inputs


def engine_env(wildcards):
    """Conda environment of the engine rules: the CUDA one for the cuda tier."""
    return (
        "../../envs/cuda.yaml" if wildcards.device == "cuda" else "../../envs/cpu.yaml"
    )


def engine_params(wildcards):
    """The engine section minus what the workflow consumes; the disk tier's expert file lives
    under results/ (for a real checkpoint too, never beside the user's checkpoint). Generation
    shares it (its jobs have no device wildcard: generate.device decides)."""
    params = section("engine", exclude=["devices", "policies", "sizes", "bench"])
    # dtype null: the engine picks it per device (moesub.engine.spec.engine_dtype)
    device = wildcards.device if "device" in wildcards.keys() else "generate"
    dtype = params.get("dtype") or f"auto-{device}"
    if not params.get("store_path"):
        params["store_path"] = f"results/{wildcards.model}/engine/experts-{dtype}.bin"
    return canonical(params)


def bench_trace_model():
    """The model whose captured router trace the benchmark replays (None: synthetic routing)."""
    bench = config["engine"]["bench"]
    if bench["routing"] != "trace":
        return None
    name = bench.get("trace_model") or (EMBEDDED_MODELS[0] if EMBEDDED_MODELS else None)
    if name not in MODELS:
        raise ValueError(
            f"engine.bench.routing=trace: engine.bench.trace_model={name!r} is not in models "
            f"{MODELS} (null picks the first embedded model; or use routing: synthetic)"
        )
    return name


def bench_inputs(wildcards):
    """The trace model's calibration and evaluation router traces (routing=trace)."""
    name = bench_trace_model()
    if name is None:
        return {}
    return {
        "calib_router": f"results/{name}/capture/calib_router.parquet",
        "eval_router": f"results/{name}/capture/eval_router.parquet",
    }


def bench_params(wildcards):
    """The real-size benchmark's settings, with the dicts of the policies it times and the
    capture directory of its trace."""
    bench = config["engine"]["bench"]
    skip = ("enabled", "policies", "trace_model")  # the workflow's keys
    params = {k: v for k, v in bench.items() if k not in skip}
    if BENCH_POLICIES is not None:
        params["policies"] = {name: policy_dict(name) for name in BENCH_POLICIES}
    name = bench_trace_model()
    if name is not None:
        params["trace_dir"] = f"results/{name}/capture"
    return canonical(params)


def task_path(wildcards):
    """A generation task's data path (None: the task's bundled default)."""
    return config["generate"]["tasks"][wildcards.task].get("path")


def task_data(wildcards):
    """The task's data file (checked to exist at parse time), when the config names one."""
    return config_inputs(f"generate.tasks.{wildcards.task}.path")


def generate_reference(wildcards):
    """The baseline policy's output of the same task: other policies' agreement is measured
    against it (the baseline itself, or a run without the baseline, has none)."""
    baseline = config["analysis"]["baseline"]
    if wildcards.policy == baseline or baseline not in TASK_POLICIES[wildcards.task]:
        return []
    return [
        f"results/{wildcards.model}/generate/{wildcards.task}/{baseline}/{wildcards.size}.parquet"
    ]


def generate_params(wildcards):
    """Generation settings of this task (over the shared decoding settings), plus the reference."""
    task = {
        k: v
        for k, v in config["generate"]["tasks"][wildcards.task].items()
        if k not in ("path", "policies")
    }
    shared = section("generate", exclude=["tasks", "policies", "sizes"])
    # the evaluation text (a task reading held-out text, the continuation, takes it from here)
    params = {**shared, **task, "source": config["streams"]["source"]}
    reference = generate_reference(wildcards)
    if reference:
        params["reference_path"] = reference[0]
    return canonical(params)


def analysis_params():
    """What the statistics need besides the artefacts: policies, baselines, Experiment B rules."""
    expb_rules = {
        design: {k: v for k, v in spec.items() if k != "masses"}
        for design, spec in EXPB_DESIGNS.items()
    }
    if EXPB_FACTORIAL["enabled"]:
        expb_rules["factorial"] = {"max_weight_gap": EXPB_FACTORIAL["max_weight_gap"]}
    params = {
        **config["analysis"],
        "policies": POLICIES,
        "expb": {"alpha": config["expb"]["alpha"], "designs": expb_rules},
    }
    return canonical(params)


def study_profile_input():
    """The study's hardware profile priced for the model, where this run prices it (the
    recommendation's comparison with the study's table reads its seconds)."""
    if STUDY_PROFILE not in HARDWARE:
        return {}
    return {"study_profile": f"results/{{model}}/hardware/{STUDY_PROFILE}.json"}


def plans():
    """Every plan the pipeline writes: per captured model, hardware and cache size (a plan
    names the checkpoint a runtime loads; a trace model has none)."""
    return [
        f"results/{model}/plan/{hardware}/{size}.json"
        for model in CAPTURED_MODELS
        for hardware in MODEL_HARDWARE[model]
        for size in STAGE_SIZES["simulate"]
    ]


def report_params():
    """The configuration shown in the report (validated, defaults filled, policies expanded)."""
    return canonical({**config, "policies": POLICIES})


# Final artefacts of each stage (for analysis, report and the dry-run listing).


def simulate_outputs():
    return [
        f"results/{model}/simulate/{policy}/{size}.parquet"
        for model in MODELS
        for policy in MODEL_POLICIES[model]
        for size in STAGE_SIZES["simulate"]
    ]


def emulate_outputs():
    return expand(
        "results/{model}/emulate/{policy}/{size}.parquet",
        model=CAPTURED_MODELS,
        policy=EMULATE_POLICIES,
        size=STAGE_SIZES["emulate"],
    )


def expb_outputs():
    return [
        f"results/{model}/expb/{design}/{condition}/m{number_label(mass)}.parquet"
        for model in CAPTURED_MODELS
        for design, spec in EXPB_DESIGNS.items()
        for mass in spec["masses"]
        for condition in ("heavy", "light")
    ]


def expb_feasibility_outputs():
    return expand("results/{model}/expb/feasibility.parquet", model=CAPTURED_MODELS)


def expb_inputs(wildcards):
    """An Experiment B job's inputs; the matched design also plans on the evaluation router
    logits and checks its target against the feasibility pass."""
    inputs = {
        "model": model_artefact(wildcards.model),
        "tokens": f"results/{wildcards.model}/capture/eval_tokens.parquet",
        "ranking": f"results/{wildcards.model}/expert_ranking.parquet",
    }
    if wildcards.design == "matched":
        inputs["router"] = f"results/{wildcards.model}/capture/eval_router.parquet"
        inputs["feasibility"] = f"results/{wildcards.model}/expb/feasibility.parquet"
    return inputs


def expb_params(wildcards):
    """What one Experiment B job reads: the shared settings, plus the matched design's heavy
    mass and hash seed for its jobs only (a study job does not rerun when they change).
    """
    params = section("expb", exclude=EXPB_ANALYSIS_KEYS + ["seed"])
    if wildcards.design == "matched":
        params["seed"] = config["expb"]["seed"]
        params["heavy_mass"] = EXPB_DESIGNS["matched"]["heavy_mass"]
    return canonical(params)


def expb_factorial_outputs():
    if not EXPB_FACTORIAL["enabled"]:
        return []
    return expand(
        "results/{model}/expb/factorial/{cell}.parquet",
        model=CAPTURED_MODELS,
        cell=FACTORIAL_CELLS,
    )


def expb_factorial_feasibility_outputs():
    if not EXPB_FACTORIAL["enabled"]:
        return []
    return expand(
        "results/{model}/expb/factorial_feasibility.parquet", model=CAPTURED_MODELS
    )


def expb_factorial_spec():
    """The factorial design's cells and count: its plan (feasibility and runs) reads these."""
    return canonical(
        {
            k: v
            for k, v in EXPB_FACTORIAL.items()
            if k not in EXPB_FACTORIAL_ANALYSIS_KEYS
        }
    )


def expb_factorial_params(wildcards):
    """What a factorial run reads from `expb:` besides its spec (the shared settings, the seed
    of the plan's hash)."""
    return section("expb", exclude=EXPB_ANALYSIS_KEYS)


def engine_outputs():
    return expand(
        "results/{model}/engine/{device}/{policy}/{size}.parquet",
        model=CAPTURED_MODELS,
        device=ENGINE_DEVICES,
        policy=ENGINE_POLICIES,
        size=STAGE_SIZES["engine"],
    )


def priced_outputs():
    return [
        f"results/{model}/priced/{hardware}.parquet"
        for model in MODELS
        for hardware in MODEL_HARDWARE[model]
    ]


def calibration_outputs():
    return expand(
        "results/{model}/engine/{device}/calibration.json",
        model=CAPTURED_MODELS,
        device=ENGINE_DEVICES,
    )


def bench_outputs():
    if not config["engine"]["bench"]["enabled"]:
        return []
    return expand("results/engine_bench/{device}.parquet", device=ENGINE_DEVICES)


def generate_outputs():
    return [
        path
        for task, policies in TASK_POLICIES.items()
        for path in expand(
            "results/{model}/generate/{task}/{policy}/{size}.parquet",
            model=CAPTURED_MODELS,
            task=task,
            policy=policies,
            size=STAGE_SIZES["generate"],
        )
    ]


def analysis_inputs():
    """Every artefact the analysis reads, by kind (the dict handed to moesub.stats)."""
    return {
        "model_summary": [model_artefact(m) for m in MODELS],
        "capture_tokens": expand(
            "results/{model}/capture/eval_tokens.parquet", model=CAPTURED_MODELS
        ),
        "regime": expand("results/{model}/regime.parquet", model=MODELS),
        "regime_designs": expand(
            "results/{model}/regime_designs.parquet", model=MODELS
        ),
        "simulate": simulate_outputs(),
        "priced": priced_outputs(),
        "emulate": emulate_outputs(),
        "expb": expb_outputs(),
        "expb_feasibility": expb_feasibility_outputs(),
        "expb_factorial": expb_factorial_outputs(),
        "expb_factorial_feasibility": expb_factorial_feasibility_outputs(),
        "calibration": calibration_outputs(),
        "engine": engine_outputs(),
        "engine_bench": bench_outputs(),
        "generate": generate_outputs(),
    }
