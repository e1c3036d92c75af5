# moesub: which expert misses are worth waiting for?
#
# One DAG from model to report:
#   snakemake --cores 2                  (this machine / a laptop: profiles/default is implicit)
#   snakemake --profile profiles/slurm   (a SLURM cluster, from a login node)
# Stages and artefact paths: docs/architecture.md. Science settings: config.yaml (schema in
# workflow/schemas/); resources per rule: profiles/.


from snakemake.utils import min_version

from moesub.config import validate_config
from moesub.cpu_kernels import pin_cpu_kernels

min_version("9.0")


# config.yaml is the configuration unless --configfile names another complete one (e.g. the test
# config): a --configfile replaces it instead of being merged into it, here and in cluster jobs.
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


# The schema's checks and defaults (workflow/schemas/config.schema.yaml); a bad key is one short
# error naming its path and what is allowed there.
validate_config(config)
# Jobs inherit the kernels pinned here (read once per process, at its first kernel).
pin_cpu_kernels(config["cpu_kernels"])


include: "workflow/rules/common.smk"


# Wildcard values are exactly the configured names (so paths never match across levels).
wildcard_constraints:
    model=alternation(MODELS),
    policy=alternation([*POLICIES, ALL_RESIDENT]),
    size=alternation(SIZES),
    mass=r"[0-9.]+",
    device=r"cpu|cuda",
    hardware=alternation(HARDWARE),
    split=r"eval|calib",
    condition=r"heavy|light",
    design=r"study|matched",
    cell=alternation(FACTORIAL_CELLS),
    task=alternation(TASKS),


include: "workflow/rules/model.smk"
include: "workflow/rules/streams.smk"
include: "workflow/rules/capture.smk"
include: "workflow/rules/traces.smk"
include: "workflow/rules/allocation.smk"
include: "workflow/rules/regime.smk"
include: "workflow/rules/simulate.smk"
include: "workflow/rules/price.smk"
include: "workflow/rules/emulate.smk"
include: "workflow/rules/expb.smk"
include: "workflow/rules/engine.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/analysis.smk"
include: "workflow/rules/recommend.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/report.smk"


localrules:
    all,


rule all:
    default_target: True
    input:
        "results/report.html",  # its inputs: every stage's outputs and the plans
