"""Statistics over the Parquet artefacts (DuckDB + scipy): the study's conclusions.

`run_analysis(inputs, params, out_dir)` reads every artefact through DuckDB and writes, each
atomically (`moesub.io`), into `out_dir`:

- `analysis.json`: status of every part (ok / missing + reason), the scalar results (the
  verdict on each of the study's claims, the test families, mass hypothesis, Experiment B
  decision, admission totals and tests, simulator error), params, `ci_label` (e.g. "95%", from
  ci_level), units, provenance;
- `models.parquet`: one row per model: summary JSON facts, E, k, L, capacity per fraction;
- `summary.parquet`: one row per (policy, fraction): quality (Δppl % with BCa CI, bias and
  minimum detectable Δppl; mass per token-layer with CI), substitution, cache, time, speedups,
  generation;
- `mass_points.parquet`: per (fraction, policy): its group, mass, Δppl, whether it is a point
  of the mass-hypothesis r (`used`, else `why_out`) and its cluster of mass;
- `per_input.parquet`: per (policy, fraction, level): r between per-unit mass and ΔNLL;
- `per_input_points.parquet`: per (policy, fraction, level, unit): mean mass, mean ΔNLL;
- `expb.parquet`: per (design, target mass): Experiment B's decision, realized masses per
  token-layer, effect with CI, rank confound; `expb_streams.parquet`: per (design, target mass,
  stream): realized masses, ΔNLL, the paired difference;
- `expb_factorial.parquet`: per test of the factorial design (weight at a fixed rank, rank at a
  fixed weight; pooled and per bucket): estimate in ΔNLL per substituted token-layer with CI,
  raw p, MDE, verdict, the cells' balance; `expb_factorial_cells.parquet`: per cell;
  `expb_factorial_streams.parquet`: per (cell, stream);
- `admission.parquet`: per (policy, fraction, segment, bin of tokens since the document start):
  ΔNLL vs the exact twin with CI and bias;
- `allocation.parquet`: per (planned policy, fraction): its slots, hit rate and Δppl beside its
  uniform counterpart's, the paired Δppl difference with CI and p, the simulated time ratio;
- `speed_quality.parquet`: per (policy, fraction, time source): time/token, Δppl %, frontier;
- `sim_vs_engine.parquet`: per (policy, fraction, device): estimated vs measured time/token,
  the error's interval over the run's streams resampled;
- `layer_hit_rates.parquet`: per (policy, fraction, layer), from simulate;
- `engine_bench.parquet`: the engine benchmark rows as measured, each error with its interval
  over the policy's rounds resampled;
- `generation.parquet`: per (task, policy, fraction): accuracy, agreement (Wilson CIs),
  r(mass, agreement);
- `degeneration.parquet`: per (task, policy, fraction, measure) of the free continuations:
  repeated 4-grams, longest repeated span, share ending in a loop, each with a CI over
  prompts and a paired test against the baseline (raw p), beside the policy's Δppl;
- `design_space.parquet`: per simulated (policy, fraction): family, hit rate, misses per
  token, estimated time per token, Δppl % with CI (emulated, or 0 for a lossless policy), the
  gap to its Belady bound, the Pareto fronts; `design_families.parquet`: per (family,
  fraction): its best policy and its policies on each front;
- `regime.parquet`: per (layer, metric) the model's cache regime (static-skew measures beside
  the real reference model's among them); `regime_designs.parquet`: per (pinning or allocation
  design, size) its hit rate and misses per token beside its counterpart's on the evaluation
  trace and on the skew-matched trace, and how its gain changes under the real model's skew;
- `selection.parquet`: per (policy, fraction, half of a seeded split of the evaluation
  streams): Δppl % with its interval on that half's streams (the recommendation screens on
  one half and reports the other);
- `tests.parquet`: every test, its family (pre-registered: Holm; exploratory:
  Benjamini-Hochberg), estimate, two-sided interval, t-based sensitivity interval, raw and
  adjusted two-sided p, direction in words, MDE (`moesub.stats.multiplicity`).

Every bootstrapped estimate `x` comes with `x_ci_lo, x_ci_hi, x_bias, x_ci_method` and the
t-based sensitivity interval `x_t_ci_lo, x_t_ci_hi` (`moesub.stats.intervals`); every test
with the smallest p the design can reach and its minimum detectable effect, a
normal-approximation sensitivity figure (`moesub.stats.power`). Substituted mass is per
token-layer everywhere.

Every output file is written even when its part is missing (then with no rows), so a workflow
rule can name them all; `analysis.json["parts"][part]` says why a part is missing. Artefacts of
several models (`results/{model}/...`) are analysed separately: every table has a `model`
column and every scalar result in analysis.json a `model` key.

Modules, one per part (each documents its decisions):

- `load`: input checking, file metadata (`FileInfo`), the split by model, the models row and
  provenance; `tokens`: one model's per-token tables in DuckDB (`Tokens`: `cap`, `emu`,
  `emu_base`);
- `intervals`: stream bootstrap (BCa / basic, bias, t-based sensitivity interval, the p-value
  that inverts the interval), correlation, Wilson and median CIs;
- `power`: smallest reachable p-value and minimum detectable effects;
- `multiplicity`: the `StatTest` record, the families (`FAMILY`: one line per kind of test),
  Holm and Benjamini-Hochberg, the direction in words;
- `claims`: the study's claims and this run's verdict on each;
- `quality`: per-policy quality and the 0.15 rule's contrast (Δppl and speedup themselves are
  `moesub.metrics`);
- `mass`: the mass hypothesis; `per_input`: its per-input form;
- `expb`: Experiment B (study, matched); `expb_factorial`: its factorial design; `admission`:
  admission vs its twin; `timing`: simulate, engine,
  speed/quality frontier, simulator vs engine; `pricing_error`: the pricing's error against the
  engine with its intervals (over parts, jackknife), and the shared engine bench;
  `generation`: accuracy and agreement;
  `degeneration`: repetition and loops in free continuations;
  `design`: the design space (policy v2 families, Belady gaps, fronts); `regime`: the cache
  regime; `summary`: the per-(policy, fraction) summary; `selection`: the recommendation's
  split of the streams;
- `params`: `AnalysisParams` (the config's `analysis:` plus policies) and `ExpBRule`;
- `run`: `run_analysis`, `analyse_model` (the data flow of one model), the output files.

Part interface: a part is a function of the tables it needs and the params it uses, returning a
NamedTuple of its tables (DataFrames without the `model` column: `run_analysis` adds it), its
JSON-able results (tagged with `model` by `run_analysis`) and its `status` (`{"status": "ok"}`
or `missing(reason)`, the entry of `analysis.json["parts"]`). Its inputs are the loaded token
tables (`Tokens`), the `FileInfo`s of one artefact kind (with the DuckDB connection that reads
them), or tables an earlier part returned; `run.analyse_model` calls the parts in data-flow
order and maps their tables onto `OUTPUT_FILES`:

    quality(tokens, p) -> Quality(streams, table, status)
    rule_contrast(quality.streams, p) -> list[StatTest]
    mass_hypothesis(quality.streams, emulate_files, p)
        -> MassHypothesis(points, results, tests, status)
    per_input(quality.streams, tokens, p) -> PerInput(table, points, tests, status)
    selection(quality.streams, p) -> Selection(table, result, status)
    expb(tokens, expb_files, feasibility_paths, p) -> ExpB(table, streams, results, tests, status)
    expb_factorial(tokens, factorial_files, feasibility_paths, p)
        -> ExpBFactorial(table, cells, streams, results, tests, status)
    admission(tokens, emulate_files, p) -> Admission(table, totals, tests, status)
    simulate(db, simulate_files) -> Simulate(total, layers, status)
    engine(db, engine_files, p) -> Engine(table, status)
    generation(db, generate_files, p) -> Generation(table, tests, status)
    degeneration(db, generate_files, quality.table, p) -> Degeneration(table, tests, status)
    design_space(simulate.total, simulate.layers, quality.table, p)
        -> DesignSpace(table, families, status)
    speed_quality(quality.table, engine.table, simulate.total, p) -> SpeedQuality(table, status)
    sim_vs_engine(engine.table, simulate.total) -> SimVsEngine(table, result, status)
    regime(regime_paths) -> Regime(table, result, status)
    summary(quality.table, simulate.total, engine.table, generation.table, p)
        -> Summary(table, status)
    family_table(every part's tests, p.alpha) -> tests (DataFrame)
    claims(tests, quality.table, engine.table, simulate.total, p) -> Claims(results, status)
    engine_bench(paths, p) -> EngineBench(table, status, provenance)  (shared, not per model)

The statistics themselves are pure functions of DataFrames / arrays inside each part's module.
"""

from moesub.stats.admission import find_twin
from moesub.stats.intervals import (
    Interval,
    boot_counts,
    boot_indices,
    bootstrap_interval,
    correlation,
    counts_of,
    level_label,
    median_ci,
    rowwise_pearson,
    stream_bootstrap,
    wilson_ci,
    z_of,
)
from moesub.stats.load import (
    DATA_KINDS,
    EXTRA_KINDS,
    check_inputs,
    file_info,
    model_of,
    split_by_model,
)
from moesub.stats.params import AnalysisParams, ExpBRule, FactorialRule
from moesub.stats.power import paired_mde, proportion_mde, wilcoxon_min_p
from moesub.stats.run import OUTPUT_FILES, run_analysis
from moesub.stats.timing import pareto_front

__all__ = [
    "DATA_KINDS",
    "EXTRA_KINDS",
    "OUTPUT_FILES",
    "AnalysisParams",
    "ExpBRule",
    "FactorialRule",
    "Interval",
    "boot_counts",
    "boot_indices",
    "bootstrap_interval",
    "check_inputs",
    "correlation",
    "counts_of",
    "file_info",
    "find_twin",
    "level_label",
    "median_ci",
    "model_of",
    "paired_mde",
    "pareto_front",
    "proportion_mde",
    "rowwise_pearson",
    "run_analysis",
    "split_by_model",
    "stream_bootstrap",
    "wilcoxon_min_p",
    "wilson_ci",
    "z_of",
]
