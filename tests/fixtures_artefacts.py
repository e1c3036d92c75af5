"""Small synthetic, schema-correct artefacts (docs/architecture.md "Column schemas") with known
statistics, for tests of `moesub.stats` and `moesub.report`.

`make_study(root)` writes a whole study (capture tokens, simulate, emulate, Experiment B and
its factorial design, engine, engine bench, generate, model summary) and returns
`(inputs, params)` for `run_analysis`. With `noise=0` and `admission_gain=0` its numbers are
exact by construction:

- every policy p has per-token mass `m_p * g_s` (g_s a per-stream factor, mean 1) and per-token
  ΔNLL `k_p * mass`, with `k_p` chosen so that Δppl % = `DPPL_PER_MASS * mean mass` exactly:
  r(mass, Δppl) = 1 across policies and r(mass, ΔNLL) = 1 across streams and documents;
- engine time per token is the constant `TIME[p]`: speedups are exact ratios; on this_machine
  the pricing gives the simulator's tokens 1.1 x `TIME[p]` and the engine's own 1.05 x
  (`priced/this_machine.parquet`, `write_priced`);
- generation correctness is `problem_id < n_correct`; continuation measures are
  `continuation_measures`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa

from moesub.config import normalize_policy
from moesub.io import write_json, write_parquet

POLICIES = {
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "substitute_all": {"rule": "substitute_all", "eviction": "lru"},
    "rule_015": {"rule": "threshold", "tau": 0.15, "eviction": "lru"},
    "rule_tau0.08": {"rule": "threshold", "tau": 0.08, "eviction": "lru"},
    "first_choice": {"rule": "first_choice", "eviction": "lru"},
    "quality": {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5},
    "speed": {"rule": "first_choice", "eviction": "lfu", "beta": 0.5},
    "host_compute": {"rule": "host_compute", "eviction": "lru"},
    # the exact no-admission twins of quality and speed (same rule, tau, eviction; beta 0)
    "rule_015_lfu": {"rule": "threshold", "tau": 0.15, "eviction": "lfu"},
    "first_choice_lfu": {"rule": "first_choice", "eviction": "lfu"},
}
MASS = {  # mean substituted mass per token as emulate writes it: summed over the N_LAYERS layers
    "fetch_every_miss": 0.0,
    "substitute_all": 1.2,
    "rule_015": 0.30,
    "rule_tau0.08": 0.12,
    "first_choice": 0.36,
    "quality": 0.24,
    "speed": 0.28,
    "host_compute": 0.0,
    "rule_015_lfu": 0.27,
    "first_choice_lfu": 0.32,
}
DPPL_PER_MASS = 20.0  # Δppl % per unit mean mass for policies that fetch the first choice
DPPL_SUBSTITUTE_ALL = 150.0
TIME = {  # engine seconds per token
    "fetch_every_miss": 0.030,
    "substitute_all": 0.008,
    "rule_015": 0.013,
    "rule_tau0.08": 0.018,
    "first_choice": 0.011,
    "quality": 0.012,
    "speed": 0.010,
    "host_compute": 0.045,
    "rule_015_lfu": 0.0125,
    "first_choice_lfu": 0.0105,
}
N_CORRECT = {"gsm8k": 12, "humaneval": 8}  # baseline; each policy loses round(10 * mass)
N_LAYERS = 4
FRACTION = 0.25
CAPACITY = 128
MODEL = "tiny"


def label(x: float) -> str:
    return format(float(x), "g")


def stream_factors(n_streams: int) -> np.ndarray:
    """(S,) per-stream mass factors with mean exactly 1, deterministic, not monotone."""
    g = np.linspace(0.5, 1.5, n_streams)
    return g[np.argsort(np.arange(n_streams) * 7 % n_streams)]


def tokens_table(n_streams: int, tokens: int, doc_len: int, seed: int) -> dict[str, np.ndarray]:
    """Capture tokens: stream, pos, token_id, doc_id, doc_start, nll (NaN at pos 0 -> null)."""
    rng = np.random.default_rng(seed)
    stream = np.repeat(np.arange(n_streams, dtype=np.int32), tokens)
    pos = np.tile(np.arange(tokens, dtype=np.int32), n_streams)
    docs_per_stream = math.ceil(tokens / doc_len)
    doc_id = (stream * docs_per_stream + pos // doc_len).astype(np.int32)
    nll = rng.gamma(4.0, 1.0, size=stream.size)
    nll[pos == 0] = np.nan
    return {
        "stream": stream,
        "pos": pos,
        "token_id": rng.integers(0, 8192, stream.size).astype(np.int32),
        "doc_id": doc_id,
        "doc_start": (pos % doc_len) == 0,
        "nll": nll,
    }


def _nll_array(x: np.ndarray) -> pa.Array:
    return pa.array(x, type=pa.float64(), from_pandas=True)  # NaN -> null


def write_capture(root: Path, tok: dict[str, np.ndarray], model: str = MODEL) -> Path:
    path = root / "capture" / "eval_tokens.parquet"
    table = pa.table(
        {**{k: v for k, v in tok.items() if k != "nll"}, "nll": _nll_array(tok["nll"])}
    )
    return write_parquet(table, path, metadata={"model": model})


def since_doc_start(tok: dict[str, np.ndarray]) -> np.ndarray:
    """Tokens since the last doc_start in the same stream (from the stream start before one)."""
    since = np.zeros(tok["pos"].size, dtype=np.int64)
    last = 0
    for i, (p, start) in enumerate(zip(tok["pos"], tok["doc_start"], strict=True)):
        if p == 0 or start:
            last = p
        since[i] = p - last
    return since


def write_emulate(
    root: Path,
    name: str,
    policy: dict,
    tok: dict[str, np.ndarray],
    nll: np.ndarray,
    mass: np.ndarray,
    fraction: float = FRACTION,
    sub_per_token: np.ndarray | None = None,
) -> Path:
    """Emulate artefact for one policy: per-token nll / mass (+ plausible counts)."""
    n = nll.size
    k_slots = 10 * N_LAYERS
    sub = (
        sub_per_token
        if sub_per_token is not None
        else np.minimum(np.round(mass * 10).astype(np.int64), k_slots)
    )
    host = np.full(n, k_slots // 4 if policy["rule"] == "host_compute" else 0)
    fetch = np.full(n, k_slots // 4) - (host > 0) * (k_slots // 4)
    fetch = np.maximum(fetch - sub, 0)
    hit = k_slots - sub - fetch - host
    layer_mass = [list(np.full(N_LAYERS, m / N_LAYERS)) for m in mass]
    table = pa.table(
        {
            "stream": tok["stream"],
            "pos": tok["pos"],
            "doc_id": tok["doc_id"],
            "doc_start": tok["doc_start"],
            "nll": _nll_array(nll),
            "mass": mass.astype(np.float64),
            "layer_mass": pa.array(layer_mass, type=pa.list_(pa.float64())),
            "hit": hit.astype(np.int32),
            "fetch": fetch.astype(np.int32),
            "sub": sub.astype(np.int32),
            "host": host.astype(np.int32),
            "forced": np.zeros(n, dtype=np.int32),
            "prefetches": np.zeros(n, dtype=np.int32),
        }
    )
    path = root / "emulate" / name / f"f{label(fraction)}.parquet"
    meta = {
        "policy": policy,
        "name": name,
        "fraction": fraction,
        "capacity": CAPACITY,
        "core_build_id": "test-core-0001",
    }
    return write_parquet(table, path, metadata=meta)


def write_simulate(root: Path, name: str, policy: dict, fraction: float = FRACTION) -> Path:
    m = MASS[name]
    rows = []
    tokens = 512
    for layer in [*range(N_LAYERS), -1]:
        hit_rate = 0.77 - 0.03 * layer if layer >= 0 else 0.77 - 0.045
        hit_rate = min(hit_rate + (0.1 if policy["beta"] > 0 else 0.0), 0.99)
        sub_rate = min(m / 4, 1 - hit_rate) if layer >= 0 else min(m / 4, 1 - hit_rate)
        calls = tokens * 10 * (N_LAYERS if layer == -1 else 1)
        rows.append(
            {
                "policy": name,
                "fraction": fraction,
                "capacity": CAPACITY,
                "layer": layer,
                "tokens": tokens,
                "hit": int(hit_rate * calls),
                "fetch": int((1 - hit_rate - sub_rate) * calls),
                "sub": int(sub_rate * calls),
                "host": 0,
                "forced": 0,
                "admissions": 3 if policy["beta"] > 0 else 0,
                "evictions": 10,
                "hit_rate": hit_rate,
                "sub_rate": sub_rate,
                "mass_mean": m / N_LAYERS if layer >= 0 else m,
                "mass_p50": m / N_LAYERS,
                "mass_p90": m / 2,
                "mass_p99": m,
                "belady_hit_rate": 0.85 if policy["rule"] == "fetch_all" else None,
            }
        )
    path = root / "simulate" / name / f"f{label(fraction)}.parquet"
    return write_parquet(pa.Table.from_pylist(rows), path)


# Simulate-only policies of the design space (policy v2 and Belady bounds), with known totals:
# name -> (policy, hit rate, substituted mass per token-layer, est. time per token)
DESIGN = {
    "prefetch_10": ({"rule": "fetch_all", "eviction": "lru", "prefetch": 10}, 0.80, 0.0, 0.028),
    "hybrid_015": (
        {"rule": "threshold", "tau": 0.15, "eviction": "lru", "light_miss": "host"},
        0.74,
        0.0,
        0.016,
    ),
    "cache_prior_0.1": (
        {"rule": "fetch_all", "eviction": "lru", "route_bias": 0.1},
        0.86,
        0.0,
        0.020,
    ),
    "fetch_every_miss_belady": ({"rule": "fetch_all", "eviction": "belady"}, 0.90, 0.0, 0.021),
    "rule_015_belady": (
        {"rule": "threshold", "tau": 0.15, "eviction": "belady"},
        0.88,
        0.04,
        0.011,
    ),
    "prefetch_10_belady": (
        {"rule": "fetch_all", "eviction": "belady", "prefetch": 10},
        0.93,
        0.0,
        0.020,
    ),
}
DESIGN_TOKENS = 512  # tokens per simulated layer


def write_design_simulate(root: Path, name: str, fraction: float = FRACTION) -> Path:
    """A simulate artefact of a `DESIGN` policy: every layer at its hit rate; the misses are
    host computations for light_miss='host' (half of them), else fetches."""
    policy, hit_rate, mass, time = DESIGN[name]
    rows = []
    for layer in [*range(N_LAYERS), -1]:
        n = N_LAYERS if layer == -1 else 1
        calls = DESIGN_TOKENS * 10 * n
        hit = int(round(hit_rate * calls))
        host = (calls - hit) // 2 if policy.get("light_miss") == "host" else 0
        rows.append(
            {
                "policy": name,
                "fraction": fraction,
                "capacity": CAPACITY,
                "layer": layer,
                "tokens": DESIGN_TOKENS * n,
                "hit": hit,
                "fetch": calls - hit - host,
                "sub": 0,
                "host": host,
                "forced": 0,
                "admissions": 0,
                "evictions": 10,
                "prefetches": 3 * DESIGN_TOKENS * n if policy.get("prefetch") else 0,
                "hit_rate": hit / calls,
                "sub_rate": 0.0,
                "mass_mean": mass,
                "mass_p50": mass,
                "mass_p90": mass,
                "mass_p99": mass,
                "rerouted_mean": 0.01 if policy.get("route_bias") else 0.0,
                "belady_hit_rate": None,
            }
        )
    path = root / "simulate" / name / f"f{label(fraction)}.parquet"
    return write_parquet(pa.Table.from_pylist(rows), path)


def add_design_space(root: Path, inputs: dict, params: dict, model: str = MODEL) -> None:
    """Add every `DESIGN` policy's simulate artefact (and its price on this_machine) to a
    `make_study` result (in place)."""
    rows = []
    for name, (policy, _hit, _mass, time) in DESIGN.items():
        inputs["simulate"].append(str(write_design_simulate(Path(root) / model, name)))
        params["policies"][name] = normalize_policy(name, policy)
        rows.append(priced_row("simulator", name, time))
    write_priced(Path(root) / model, rows)
    # the host-computing policies under the study's GPU profile: the host path hidden behind
    # the GPU's (concurrent) against the sum
    study = [
        {**priced_row("simulator", n, t), "hardware": STUDY_HARDWARE,
         "time_per_token_serial_s": t + hidden, "hidden_host_per_token_s": hidden}
        for n, t, hidden in CONCURRENT
    ]  # fmt: skip
    inputs["priced"].append(str(write_priced(Path(root) / model, study, STUDY_HARDWARE)))


STUDY_HARDWARE = "rtx3090_pcie4_ddr4"
# (policy, ms per token with the host concurrent, host ms hidden by it) on the study profile
CONCURRENT = (("host_compute", 0.004, 0.003), ("hybrid_015", 0.002, 0.0005))


PRICED = "this_machine"
# the calibration's runs priced at the profile fitted to them (the bench's metadata, and
# this_machine's priced table's)
CALIBRATION_RUN_ERRORS = {"cal_hits": -0.002, "cal_fetch": -0.031, "cal_host": 0.004,
                          "cal_admit": -0.12}  # fmt: skip


def priced_row(
    source: str, name: str, time: float, measured: float | None = None, fraction=FRACTION
) -> dict:
    """A row of `priced/this_machine.parquet` (moesub.price.PRICED_COLUMNS): all the time in
    the fast tier's compute; an engine run's tokens priced at its disk's speed 2% over its
    measured time, and at its disk and speed 1% over."""
    from moesub.pricing import BREAKDOWN

    return {
        "hardware": PRICED, "source": source, "device": "cpu" if source == "engine" else None,
        "policy": name, "fraction": fraction, "tokens": 512, "time_per_token_s": time,
        "time_per_token_serial_s": time, "hidden_host_per_token_s": 0.0,
        **{f"{p}_s": time if p == "fast_compute" else 0.0 for p in BREAKDOWN},
        "measured_time_per_token_s": measured, "cpu_share": 0.95 if measured else None,
        "other_cores": 0.01 if measured else None, "contended": False if measured else None,
        "time_per_token_at_run_disk_s": 1.02 * measured if measured else None,
        "run_speed": 1.03 if measured else None,
        "time_per_token_at_run_speed_s": 1.01 * measured if measured else None,
        # 4 streams of 128 tokens, priced 4% under and over the run's ratio in two of them
        "stream_time_s": [measured * 128] * 4 if measured else None,
        "stream_priced_s": [time * 128 * f for f in (0.96, 1.04, 1.0, 1.0)] if measured else None,
        # 4 rounds of the engine stage, each left out with the calibration refitted without it
        "jackknife_rel_error": JACKKNIFE_JOINT if measured else None,
        "calibration_jackknife_rel_error": JACKKNIFE_ALONE if measured else None,
    }  # fmt: skip


# an engine run's errors with each of 4 rounds left out (the fixture's error is +5%): with the
# calibration refitted without it (joint), and the calibration alone
JACKKNIFE_JOINT = [0.03, 0.07, 0.05, 0.06]
JACKKNIFE_ALONE = [0.04, 0.06, 0.05, 0.05]


def write_priced(root: Path, rows: list[dict], hardware: str = PRICED) -> Path:
    """`rows` added to the model's `priced/{hardware}.parquet` (what is there kept)."""
    import polars as pl

    from moesub.run_speed import JACKKNIFE_ERRORS, STREAM_SUMS

    path = root / "priced" / f"{hardware}.parquet"
    types = {"device": pl.String, "cpu_share": pl.Float64, "other_cores": pl.Float64,
             "contended": pl.Boolean,
             "measured_time_per_token_s": pl.Float64,
             "time_per_token_at_run_disk_s": pl.Float64, "run_speed": pl.Float64,
             "time_per_token_at_run_speed_s": pl.Float64,
             **dict.fromkeys((*STREAM_SUMS, *JACKKNIFE_ERRORS), pl.List(pl.Float64))}  # fmt: skip
    new = pl.DataFrame(rows, schema_overrides=types)
    if path.exists():
        new = pl.concat([pl.read_parquet(path), new], how="vertical_relaxed")
    meta = {"hardware": hardware}
    if hardware == PRICED:
        meta["calibration_run_errors"] = CALIBRATION_RUN_ERRORS
    return write_parquet(new, path, metadata=meta)


def write_engine(
    root: Path,
    name: str,
    policy: dict,
    tok: dict[str, np.ndarray],
    nll: np.ndarray,
    device: str = "cpu",
    fraction: float = FRACTION,
    jitter: float = 0.0,
    seed: int = 0,
) -> Path:
    n = nll.size
    rng = np.random.default_rng(seed)
    wall = TIME[name] * (1.0 + jitter * rng.standard_normal(n).clip(-2, 2))
    table = pa.table(
        {
            "stream": tok["stream"],
            "pos": tok["pos"],
            "wall_s": wall,
            "fetch_wait_s": wall * 0.3,
            "bytes_sync": np.full(n, 1 << 20, dtype=np.int64),
            "bytes_bg": np.zeros(n, dtype=np.int64),
            "hit": np.full(n, 30, dtype=np.int32),
            "fetch": np.full(n, 5, dtype=np.int32),
            "sub": np.full(n, 5, dtype=np.int32),
            "host": np.zeros(n, dtype=np.int32),
            "forced": np.zeros(n, dtype=np.int32),
            "nll": _nll_array(nll),
        }
    )
    path = root / "engine" / device / name / f"f{label(fraction)}.parquet"
    meta = {"policy": policy, "name": name, "fraction": fraction, "device": device, "tier": "disk"}
    return write_parquet(table, path, metadata=meta)


def write_expb(
    root: Path,
    tok: dict[str, np.ndarray],
    design: str,
    condition: str,
    target: float,
    realized: float,
    dnll_per_stream: np.ndarray,
) -> Path:
    """Experiment B run: realized mass `realized` per token-layer, ΔNLL `dnll_per_stream[s]`."""
    s = tok["stream"]
    nll = tok["nll"] + dnll_per_stream[s]
    n = nll.size
    per_layer = 1 if condition == "heavy" else 4  # substituted experts per token-layer
    rank = 3 if condition == "heavy" else 7  # the rank confound: light experts rank worse
    table = pa.table(
        {
            "stream": s,
            "pos": tok["pos"],
            "doc_id": tok["doc_id"],
            "doc_start": tok["doc_start"],
            "nll": _nll_array(nll),
            "mass": np.full(n, realized),
            "layer_mass": pa.array(
                [[realized] * N_LAYERS] * n, type=pa.list_(pa.float64(), N_LAYERS)
            ),
            "n_sub": np.full(n, per_layer * N_LAYERS, dtype=np.int32),
            "rank_sum": np.full(n, rank * per_layer * N_LAYERS, dtype=np.int32),
            "n_planned": np.full(n, per_layer * N_LAYERS, dtype=np.int32),
        }
    )
    path = root / "expb" / design / condition / f"m{label(target)}.parquet"
    meta = {"design": design, "condition": condition, "target_mass": target}
    if design == "matched":
        meta.update(heavy_mass=0.15, plan_support=0.3, plan_share=target / (0.3 * 0.15))
    return write_parquet(table, path, metadata=meta)


EXPB_CASES = ("heavy_worse", "no_evidence", "invalid_mass", "invalid_gap")


def write_expb_case(root: Path, tok: dict[str, np.ndarray], case: str, primary: float) -> list:
    """Matched-design heavy/light runs at m* whose decision is `case`, and at 2 m*; the study
    design at m* (valid, heavy worse per unit mass)."""
    if case not in EXPB_CASES:
        raise ValueError(f"case must be one of {EXPB_CASES}")
    n_streams = int(tok["stream"].max()) + 1
    base = 0.05 + 0.01 * np.arange(n_streams)  # ΔNLL per unit mass, light condition
    paths = []
    for target in (primary, 2 * primary):
        m_h = 0.8 * target if case == "invalid_mass" else target
        m_l = 1.1 * target if case == "invalid_gap" else m_h
        factor = 0.5 if case == "no_evidence" else 2.0  # heavy ΔNLL per unit mass vs light
        paths.append(write_expb(root, tok, "matched", "heavy", target, m_h, factor * base * m_h))
        paths.append(write_expb(root, tok, "matched", "light", target, m_l, base * m_l))
    paths.append(write_expb(root, tok, "study", "heavy", primary, primary, 2 * base * primary))
    paths.append(write_expb(root, tok, "study", "light", primary, primary, base * primary))
    return paths


FACTORIAL_SPEC = {"low_ranks": [3, 3], "high_ranks": [6, 6], "light": [0.07, 0.09],
                  "heavy": [0.095, 0.107], "share": 1.0}  # fmt: skip
# (realized gate weight, rank) of each factorial cell's substituted expert
FACTORIAL_CELLS = {"low_light": (0.082, 3), "low_heavy": (0.102, 3),
                   "high_light": (0.079, 6), "high_heavy": (0.098, 6)}  # fmt: skip


def write_expb_factorial(
    root: Path, tok: dict[str, np.ndarray], d_cells: dict[str, np.ndarray], per_stream: int = 4
) -> list[Path]:
    """The factorial design's four runs and its calibration feasibility table: every stream
    substitutes `per_stream` token-layers (layer 0 of its tokens 1..per_stream) in every cell,
    and its summed ΔNLL is `d_cells[cell][s] * per_stream` (all on its token 1), so that the
    stream's ΔNLL per substituted token-layer is exactly `d_cells[cell][s]`."""
    s, pos = tok["stream"], tok["pos"]
    n = s.size
    planned = (pos >= 1) & (pos <= per_stream)
    n_streams = int(s.max()) + 1
    plan = {"token_layers": n * N_LAYERS, "count": per_stream * n_streams,
            "realized_share": per_stream / (pos.max() + 1) / N_LAYERS,
            "support": {c: 0.05 for c in FACTORIAL_CELLS},
            "shared": {"weight_at_low": 0.0, "weight_at_high": 0.0, "rank_at_light": 1.0,
                       "rank_at_heavy": 1.0}}  # fmt: skip
    paths = []
    for cell, (weight, rank) in FACTORIAL_CELLS.items():
        nll = tok["nll"] + np.where(pos == 1, np.asarray(d_cells[cell])[s] * per_stream, 0.0)
        layer_mass = np.zeros((n, N_LAYERS))
        layer_mass[planned, 0] = weight
        table = pa.table(
            {
                "stream": s,
                "pos": pos,
                "doc_id": tok["doc_id"],
                "doc_start": tok["doc_start"],
                "nll": _nll_array(nll),
                "mass": layer_mass.mean(axis=1),
                "layer_mass": pa.array(list(layer_mass), type=pa.list_(pa.float64(), N_LAYERS)),
                "n_sub": planned.astype(np.int32),
                "rank_sum": (rank * planned).astype(np.int32),
                "n_planned": planned.astype(np.int32),
            }
        )
        meta = {"design": "factorial", "condition": cell, "spec": FACTORIAL_SPEC, "seed": 0,
                **{f"plan_{k}": v for k, v in plan.items()}}  # fmt: skip
        paths.append(
            write_parquet(table, root / "expb" / "factorial" / f"{cell}.parquet", metadata=meta)
        )
    feasibility = pa.table({"cell": list(FACTORIAL_CELLS), "support": [0.05] * 4})
    meta = {"design": "factorial", "spec": FACTORIAL_SPEC, "seed": 0, "max_share": 0.06,
            "all_cells": 0.0, **plan}  # fmt: skip
    paths.append(
        write_parquet(feasibility, root / "expb" / "factorial_feasibility.parquet", metadata=meta)
    )
    return paths


def write_generate(root: Path, task: str, name: str, n_problems: int = 20) -> Path:
    m = MASS[name]
    n_correct = max(N_CORRECT[task] - round(10 * m), 0)
    ids = np.arange(n_problems)
    agree_prefix = np.clip(1.0 - m * (0.5 + ids / n_problems), 0.0, 1.0)
    if name == "fetch_every_miss":
        agree_prefix = np.ones(n_problems)
    rows = {
        "task": [task] * n_problems,
        "problem_id": [f"{task}/{i}" for i in ids],
        "policy": [name] * n_problems,
        "fraction": np.full(n_problems, FRACTION),
        "output": [f"answer {i}" for i in ids],
        "correct": ids < n_correct,
        "missing_reason": [""] * n_problems,
        "agree_exact": agree_prefix >= 1.0,
        "agree_prefix_frac": agree_prefix,
        "mass_per_token_layer": m * (0.5 + ids / n_problems),
        "n_tokens": np.full(n_problems, 64, dtype=np.int32),
        "n_scored": np.full(n_problems, 64, dtype=np.int32),
    }
    path = root / "generate" / task / name / f"f{label(FRACTION)}.parquet"
    return write_parquet(rows, path)


def continuation_measures(name: str, n_prompts: int = 20) -> list[dict[str, float]]:
    """Per prompt i, exact by construction (m = MASS[name]): ends in a loop iff
    i < 2 + round(10 m); rep4 = 0.1 + 0.01 i + m (i + 1) / 100 (distinct positive differences
    from the baseline); longest repeat = 8 + i + round(20 m) (a constant difference)."""
    m = MASS[name]
    out = []
    for i in range(n_prompts):
        loop = i < 2 + round(10 * m)
        out.append(
            {
                "rep4": 0.1 + 0.01 * i + m * (i + 1) / 100,
                "longest_repeat": float(8 + i + round(20 * m)),
                "ends_in_loop": float(loop),
                "loop_period": 3.0 if loop else math.nan,
                "loop_tokens": 40.0 if loop else 0.0,
            }
        )
    return out


def write_continuation(root: Path, name: str, n_prompts: int = 20) -> Path:
    """A continuation artefact (generate schema, with measures; nothing graded)."""
    m = MASS[name]
    ids = np.arange(n_prompts)
    rows = {
        "task": ["continuation"] * n_prompts,
        "problem_id": [f"doc{i}.py@{7 * i}" for i in ids],
        "policy": [name] * n_prompts,
        "fraction": np.full(n_prompts, FRACTION),
        "output": [f"text {i}" for i in ids],
        "correct": pa.nulls(n_prompts, pa.bool_()),
        "missing_reason": [""] * n_prompts,
        "agree_exact": np.full(n_prompts, m == 0),
        "agree_prefix_frac": np.clip(1.0 - m * (0.5 + ids / n_prompts), 0.0, 1.0),
        "mass_per_token_layer": m * (0.5 + ids / n_prompts),
        "n_tokens": np.full(n_prompts, 128, dtype=np.int32),
        "n_scored": np.full(n_prompts, 128, dtype=np.int32),
        "measures": pa.array(
            continuation_measures(name, n_prompts), type=pa.map_(pa.string(), pa.float64())
        ),
    }
    path = root / "generate" / "continuation" / name / f"f{label(FRACTION)}.parquet"
    return write_parquet(pa.table(rows), path)


def write_engine_bench(root: Path, names: list[str]) -> Path:
    rows = [
        {
            "policy": n,
            "device": "cpu",
            "tier": "disk",
            "layers": 48,
            "tokens": 64,
            "time_per_token_median_s": TIME[n] * 10,
            "time_per_token_p90_s": TIME[n] * 12,
            "fetch_wait_s": TIME[n] * 3,
            "bytes_sync": 1 << 30,
            "bytes_bg": 0,
            "hit_rate": 0.9,
            "sub_rate": MASS[n] / 4,
            "speedup_vs_fetch_every_miss": TIME["fetch_every_miss"] / TIME[n],
            "speedup_vs_host_compute": TIME["host_compute"] / TIME[n],
            # the cost model's error against the engine: -4% .. +4% over the policies
            "sim_rel_error": (i % 5 - 2) * 0.02,
            "sim_rel_error_at_run_disk": (i % 5 - 2) * 0.01,  # the disk's drift taken out
            "run_speed": 1.0 + (i % 3) * 0.05,  # and the machine's compute speed too
            "sim_rel_error_at_run_speed": (i % 5 - 2) * 0.005,
            # 4 rounds, priced 3% under and over the error in two (the analysis' interval)
            "round_time_s": [TIME[n] * 160] * 4,
            "round_priced_s": [
                TIME[n] * 160 * (1 + (i % 5 - 2) * 0.02) * f for f in (0.97, 1.03, 1.0, 1.0)
            ],  # fmt: skip
        }
        for i, n in enumerate(names)
    ]
    # the calibration runs priced at the profile fitted to them, as the bench's metadata has them
    meta = {"device": "cpu", "calibration_run_errors": CALIBRATION_RUN_ERRORS}
    return write_parquet(
        pa.Table.from_pylist(rows), root / "engine_bench" / "cpu.parquet", metadata=meta
    )


def policy_nll(
    name: str, tok: dict[str, np.ndarray], g: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(nll, mass) per token for policy `name` under the exact construction of the module doc."""
    m = MASS[name]
    mass = m * g[tok["stream"]]
    if m == 0:
        return tok["nll"].copy(), mass
    target = DPPL_SUBSTITUTE_ALL if name == "substitute_all" else DPPL_PER_MASS * m
    k = math.log1p(target / 100.0) / m  # mean ΔNLL = k * mean mass (mean of g is 1)
    return tok["nll"] + k * mass, mass


def make_study(
    root: Path,
    *,
    n_streams: int = 8,
    tokens: int = 64,
    doc_len: int = 16,
    names: list[str] | None = None,
    noise: float = 0.0,
    admission_gain: float = 0.0,
    expb_case: str = "heavy_worse",
    factorial_rank: float = 0.0,
    primary: float = 0.2,
    seed: int = 0,
    model: str = MODEL,
) -> tuple[dict[str, list[str]], dict]:
    """Write a whole synthetic study under `root/model`; returns (inputs, params).
    `factorial_rank`: how much more the factorial's high rank costs at a fixed weight (mean over
    the streams, in ΔNLL per substituted token-layer)."""
    root = Path(root) / model
    names = list(POLICIES) if names is None else names
    policies = {n: normalize_policy(n, POLICIES[n]) for n in names}
    tok = tokens_table(n_streams, tokens, doc_len, seed)
    g = stream_factors(n_streams)
    rng = np.random.default_rng(seed + 1)
    since = since_doc_start(tok)
    inputs: dict[str, list[str]] = {
        k: []
        for k in (
            "capture_tokens",
            "simulate",
            "emulate",
            "expb",
            "engine",
            "engine_bench",
            "generate",
            "model_summary",
            "priced",
        )
    }
    priced = []
    inputs["capture_tokens"].append(str(write_capture(root, tok, model)))
    for name, pol in policies.items():
        nll, mass = policy_nll(name, tok, g)
        if noise and MASS[name] > 0:
            nll = nll + noise * MASS[name] * rng.standard_normal(nll.size)
        if admission_gain and pol["beta"] > 0:
            nll = nll - admission_gain * np.exp(-since / 8.0)
        inputs["emulate"].append(str(write_emulate(root, name, pol, tok, nll, mass)))
        inputs["simulate"].append(str(write_simulate(root, name, pol)))
        priced += [priced_row("simulator", name, 1.1 * TIME[name]),
                   priced_row("engine", name, 1.05 * TIME[name], measured=TIME[name])]  # fmt: skip
        inputs["engine"].append(
            str(write_engine(root, name, pol, tok, nll, jitter=0.2 if noise else 0.0, seed=seed))
        )
        for task in ("gsm8k", "humaneval"):
            inputs["generate"].append(str(write_generate(root, task, name)))
        inputs["generate"].append(str(write_continuation(root, name)))
    inputs["priced"].append(str(write_priced(root, priced)))
    inputs["expb"] = [str(p) for p in write_expb_case(root, tok, expb_case, primary)]
    # the factorial design: a heavier substitution costs more, the rank `factorial_rank` more
    # (the high rank's ΔNLL alternates around that, mean difference exact over an even count)
    level = 0.01 * (1.0 + 0.1 * np.arange(n_streams))
    weight = 0.004 * g  # heavy - light per stream
    rank = factorial_rank + 0.0005 * (-1.0) ** np.arange(n_streams)
    cells = {"low_light": level, "low_heavy": level + weight, "high_light": level + rank,
             "high_heavy": level + weight + rank}  # fmt: skip
    *runs, feasibility = write_expb_factorial(root, tok, cells)
    inputs["expb_factorial"] = [str(p) for p in runs]
    inputs["expb_factorial_feasibility"] = [str(feasibility)]
    inputs["engine_bench"].append(str(write_engine_bench(root, names)))
    summary = {
        "model": model,
        "num_experts": 512,
        "top_k": 10,
        "num_layers": N_LAYERS,
        "params": 14_200_000,
        "heldout_ppl": 59.5,
    }
    inputs["model_summary"].append(str(write_json(summary, root / "model" / "train_summary.json")))
    params = {
        "policies": policies,
        "expb": {
            "alpha": 0.05,
            "designs": {
                "study": {"primary": primary, "min_heavy_fraction": 0.5, "max_gap": 0.10},
                "matched": {"primary": primary, "heavy_mass": 0.15},
                "factorial": {"max_weight_gap": 0.1},
            },
        },
        "n_boot": 200,
        "seed": 0,
    }
    json.dumps(params)  # the params must be plain JSON (as from config.yaml)
    return inputs, params


def write_ranking(path: Path, initial: np.ndarray, num_experts: int) -> Path:
    """An expert-ranking artefact whose layer l starts with `initial[l]` (in that order), the
    other experts after it by id: every prefix of length <= C is a given initial set."""
    from moesub.artefacts import write_expert_ranking

    initial = np.asarray(initial)
    counts = np.zeros((initial.shape[0], num_experts), np.int64)
    for layer, row in enumerate(initial):
        order = [*row.tolist(), *(e for e in range(num_experts) if e not in set(row.tolist()))]
        counts[layer, order] = np.arange(num_experts, 0, -1)
    return write_expert_ranking(counts, path, {})
