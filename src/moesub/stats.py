"""Statistics over the Parquet artefacts (DuckDB + scipy): the study's conclusions.

`run_analysis(inputs, params, out_dir)` reads every artefact through DuckDB and writes, each
atomically (`moesub.io`), into `out_dir`:

- `analysis.json`: status of every part (ok / missing + reason), the scalar results (mass
  hypothesis, Experiment B decision, admission totals, simulator error), params, provenance;
- `summary.parquet`: one row per (policy, fraction): quality, substitution, cache, time,
  speedups, generation;
- `mass_points.parquet`: per (fraction, group, policy): the points behind the mass-hypothesis r;
- `per_input.parquet`: per (policy, fraction, level): r between per-unit mass and ΔNLL;
- `per_input_points.parquet`: per (policy, fraction, level, unit): mean mass, mean ΔNLL;
- `expb.parquet`: per (target mass, stream): realized masses, ΔNLL, per-unit-mass difference;
- `admission.parquet`: per (policy, fraction, bin of tokens since the last doc_start);
- `speed_quality.parquet`: per (policy, fraction, time source): time/token, Δppl %, frontier;
- `sim_vs_engine.parquet`: per (policy, fraction, device): estimated vs measured time/token;
- `layer_hit_rates.parquet`: per (policy, fraction, layer), from simulate;
- `engine_bench.parquet`: the engine benchmark rows as measured;
- `generation.parquet`: per (task, policy, fraction): accuracy, agreement (Wilson CIs),
  r(mass, agreement).

Every output file is written even when its part is missing (then with no rows), so a workflow
rule can name them all; `analysis.json["parts"][part]` says why a part is missing. Artefacts of
several models (`results/{model}/...`) are analysed separately: every table has a `model`
column and every scalar result in analysis.json a `model` key.

Decisions (documented here and shown in the report):

- Δppl % of a policy is `100 * (exp(mean(nll_p - nll_base)) - 1)` over the tokens both have an
  NLL for, where the base is `fetch_every_miss` (params `baseline`) emulated at the same cache
  fraction; if that run is absent the captured exact NLL stands in (identical by construction:
  fetch_every_miss computes the original model).
- Mass hypothesis groups: "fetches first choice" = rules `threshold` and `first_choice` (any
  eviction, any beta): they may substitute, never the router's first choice. `fetch_all` and
  `host_compute` are excluded: they never substitute, so their mass and Δppl are 0 by
  construction and would add identical (0, 0) points that inflate r without information.
  "substitutes first choice" = rule `substitute_all`, shown separately (its n is often 1; r is
  reported as undefined with the reason when n < 3 or a coordinate is constant).
  Computed per cache fraction; the CI resamples streams (the same resample for every policy),
  recomputes each policy's mass and Δppl, then r.
- Experiment B: per stream s and condition c, `ΔNLL_c(s)` = mean over the stream's tokens of
  `nll_c - nll_exact` (captured) and `m_c(s)` its realized mean mass; the paired statistic is
  `d(s) = ΔNLL_heavy(s) / m_heavy(s) - ΔNLL_light(s) / m_light(s)` (streams where a realized
  mass is 0 are dropped and counted). "Within 10% of each other" means
  `|m_heavy - m_light| <= max_gap * min(m_heavy, m_light)` (each within 10% of the other).
- Admission twin: the no-admission policy (beta 0) with the same rule (and tau for `threshold`)
  and the same eviction if one ran; otherwise the same rule/tau with another eviction, `lru`
  first (then the gain includes the eviction change: `twin_exact = False` says so). Tokens
  before a stream's first doc_start count from the stream start.
- Engine time per token is the median of per-token `wall_s` (CI: distribution-free order
  statistics); speedups are ratios of medians on the same device and fraction. The simulator's
  estimate is compared with the engine's mean (an expected time per token).
- Generation CIs are Wilson score intervals; r(mass, agreement) is Spearman over problems
  (agreement = fraction of tokens before the first divergence).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from scipy import stats as sps
from tqdm.auto import tqdm

from moesub.config import normalize_policy
from moesub.io import read_metadata, write_json, write_parquet

DATA_KINDS = (
    "capture_tokens",
    "simulate",
    "emulate",
    "expb",
    "engine",
    "engine_bench",
    "generate",
)
# Non-Parquet inputs the report shows (model summary JSON, engine calibration JSON).
EXTRA_KINDS = ("model_summary", "calibration")
FETCH_FIRST_RULES = ("threshold", "first_choice")
SUBSTITUTE_FIRST_RULES = ("substitute_all",)
NEVER_SUBSTITUTE_RULES = ("fetch_all", "host_compute")
COUNT_COLS = ("hit", "fetch", "sub", "host", "forced")
PROVENANCE_KEYS = (
    "name",
    "policy",
    "fraction",
    "capacity",
    "core_build_id",
    "device",
    "tier",
    "condition",
    "target_mass",
    "model",
    "num_experts",
    "top_k",
    "num_layers",
)
OUTPUT_FILES = (
    "summary",
    "mass_points",
    "per_input",
    "per_input_points",
    "expb",
    "admission",
    "speed_quality",
    "sim_vs_engine",
    "layer_hit_rates",
    "engine_bench",
    "generation",
)


# ----------------------------------------------------------------------------------------------
# parameters and inputs


@dataclass(frozen=True)
class ExpBRule:
    """Experiment B's pre-registered decision rule (config `expb:`)."""

    primary: float  # m*: the primary target mass
    alpha: float = 0.05
    min_heavy_fraction: float = 0.5  # heavy realized mean mass must be >= this * m*
    max_gap: float = 0.10  # |m_heavy - m_light| <= max_gap * min(m_heavy, m_light)

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> ExpBRule:
        if not isinstance(spec, Mapping):
            raise ValueError(f"params['expb'] must be a mapping, got {type(spec).__name__}")
        if "primary" not in spec:
            raise ValueError("params['expb']['primary'] (the primary target mass m*) is required")
        rule = cls(
            primary=_number(spec["primary"], "params['expb']['primary']"),
            alpha=_number(spec.get("alpha", 0.05), "params['expb']['alpha']"),
            min_heavy_fraction=_number(
                spec.get("min_heavy_fraction", 0.5), "params['expb']['min_heavy_fraction']"
            ),
            max_gap=_number(spec.get("max_gap", 0.10), "params['expb']['max_gap']"),
        )
        if rule.primary <= 0:
            raise ValueError(f"params['expb']['primary']={rule.primary} must be > 0")
        if not 0 < rule.alpha < 1:
            raise ValueError(f"params['expb']['alpha']={rule.alpha} must be in (0, 1)")
        if not 0 <= rule.min_heavy_fraction <= 1 or rule.max_gap < 0:
            raise ValueError("params['expb']: min_heavy_fraction must be in [0, 1], max_gap >= 0")
        return rule


@dataclass(frozen=True)
class AnalysisParams:
    """What `run_analysis` needs from the config.

    `policies`: name -> policy dict (config `policies:` after sweep expansion); `expb`: the
    Experiment B rule (None: that part is reported missing); `n_boot` bootstrap resamples over
    streams; `seed`; `ci_level`; `baseline` / `host_baseline`: the names speedups and Δppl are
    relative to; `admission_bins`: left edges of the tokens-since-doc_start bins.
    """

    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    expb: ExpBRule | None = None
    n_boot: int = 2000
    seed: int = 0
    ci_level: float = 0.95
    baseline: str = "fetch_every_miss"
    host_baseline: str = "host_compute"
    admission_bins: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> AnalysisParams:
        if not isinstance(params, Mapping):
            raise ValueError(f"params must be a mapping, got {type(params).__name__}")
        policies = params.get("policies") or {}
        if not isinstance(policies, Mapping):
            raise ValueError("params['policies'] must map policy names to policy dicts")
        table = {str(n): normalize_policy(str(n), dict(p)) for n, p in policies.items()}
        expb = params.get("expb")
        n_boot = params.get("n_boot", 2000)
        if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
            raise ValueError(f"params['n_boot']={n_boot!r} must be an integer >= 10")
        seed = params.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"params['seed']={seed!r} must be an integer >= 0")
        ci_level = _number(params.get("ci_level", 0.95), "params['ci_level']")
        if not 0 < ci_level < 1:
            raise ValueError(f"params['ci_level']={ci_level} must be in (0, 1)")
        bins = tuple(int(b) for b in params.get("admission_bins", cls.admission_bins))
        if not bins or bins[0] != 0 or any(b >= c for b, c in pairwise(bins)):
            raise ValueError(
                f"params['admission_bins']={list(bins)} must start at 0 and strictly increase"
            )
        return cls(
            policies=table,
            expb=ExpBRule.from_mapping(expb) if expb is not None else None,
            n_boot=n_boot,
            seed=seed,
            ci_level=ci_level,
            baseline=str(params.get("baseline", "fetch_every_miss")),
            host_baseline=str(params.get("host_baseline", "host_compute")),
            admission_bins=bins,
        )


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}={value!r} must be a number")
    return float(value)


def check_inputs(inputs: Mapping[str, Any]) -> dict[str, list[str]]:
    """kind -> sorted list of existing paths; every data kind present (maybe empty)."""
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must map artefact kinds to lists of paths, got {type(inputs)}")
    out: dict[str, list[str]] = {}
    for kind, paths in inputs.items():
        if kind not in DATA_KINDS + EXTRA_KINDS:
            raise ValueError(
                f"inputs: unknown kind {kind!r}; expected some of {list(DATA_KINDS + EXTRA_KINDS)}"
            )
        if paths is None:
            paths = []
        elif isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        listed = sorted({str(p) for p in paths})
        for p in listed:
            if not Path(p).is_file():
                raise FileNotFoundError(f"inputs[{kind!r}]: {p!r} does not exist")
        out[kind] = listed
    for kind in DATA_KINDS + EXTRA_KINDS:
        out.setdefault(kind, [])
    return out


@dataclass
class FileInfo:
    """One input Parquet file: its metadata and the keys its path/metadata give it."""

    path: str
    kind: str
    rows: int
    meta: dict[str, Any]
    name: str | None = None
    fraction: float | None = None
    device: str | None = None
    condition: str | None = None
    target_mass: float | None = None


def _prefixed_number(stem: str, prefix: str) -> float | None:
    if stem.startswith(prefix):
        try:
            return float(stem[len(prefix) :])
        except ValueError:
            return None
    return None


def file_info(path: str, kind: str) -> FileInfo:
    """Metadata first, then the architecture's path layout (`.../{policy}/f{fraction}.parquet`)."""
    try:
        meta = read_metadata(path)
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - re-raised with the argument named
        raise ValueError(
            f"inputs[{kind!r}]: {path!r} is not a readable Parquet file: {exc}"
        ) from exc
    p = Path(path)
    info = FileInfo(path=path, kind=kind, rows=rows, meta=meta)
    if kind in ("simulate", "emulate", "engine"):
        name = meta.get("name")
        if not isinstance(name, str):
            name = meta.get("policy") if isinstance(meta.get("policy"), str) else p.parent.name
        info.name = name
        frac = meta.get("fraction")
        info.fraction = float(frac) if frac is not None else _prefixed_number(p.stem, "f")
        if info.fraction is None:
            raise ValueError(f"inputs[{kind!r}]: {path!r} has no fraction (metadata or f<x> name)")
        if kind == "engine":
            info.device = str(meta.get("device") or p.parent.parent.name)
    elif kind == "expb":
        info.condition = str(meta.get("condition") or p.parent.name)
        target = meta.get("target_mass")
        info.target_mass = float(target) if target is not None else _prefixed_number(p.stem, "m")
        if info.condition not in ("heavy", "light") or info.target_mass is None:
            raise ValueError(
                f"inputs['expb']: {path!r} needs condition heavy|light and a target_mass "
                f"(metadata or .../{{condition}}/m<mass>.parquet), got "
                f"{info.condition!r}, {info.target_mass!r}"
            )
    return info


# ----------------------------------------------------------------------------------------------
# small statistics helpers


def _rng(seed: int, *keys: Any) -> np.random.Generator:
    return np.random.default_rng([seed, *(zlib.crc32(str(k).encode()) for k in keys)])


def boot_counts(n_units: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot, n_units) float64: how often each unit is drawn in each resample."""
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_boot).astype(float)


def rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row pair: x, y (B, P) -> (B,), NaN where a row is constant."""
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((xc * xc).sum(axis=1) * (yc * yc).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (xc * yc).sum(axis=1) / den
    scale = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1)) + 1e-300
    return np.where(den > 1e-12 * scale, np.clip(r, -1.0, 1.0), np.nan)


def percentile_ci(samples: np.ndarray, level: float) -> tuple[float | None, float | None]:
    """Percentile interval of the finite samples (None when fewer than half are finite)."""
    s = np.asarray(samples, dtype=float)
    s = s[np.isfinite(s)]
    if s.size == 0 or s.size < 0.5 * np.asarray(samples).size:
        return None, None
    lo, hi = np.quantile(s, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


def correlation(x: Sequence[float], y: Sequence[float]) -> dict[str, Any]:
    """Pearson r (Fisher-z CI when n >= 4) and Spearman rho, or why they are undefined."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = int(x.size)
    out: dict[str, Any] = {"n": n, "r": None, "p": None, "r_ci_lo": None, "r_ci_hi": None}
    out.update({"rho": None, "rho_p": None, "reason": None})
    if n < 3:
        out["reason"] = f"undefined: n = {n} < 3"
        return out
    if np.ptp(x) <= 1e-12 * (np.abs(x).max() + 1e-300) or np.ptp(y) <= 1e-12 * (
        np.abs(y).max() + 1e-300
    ):
        out["reason"] = (
            "undefined: " + ("mass" if np.ptp(x) == 0 else "the outcome") + " is constant"
        )
        return out
    r, p = sps.pearsonr(x, y)
    out["r"], out["p"] = float(r), float(p)
    if n >= 4 and abs(r) < 1:
        z, half = math.atanh(r), 1.959963984540054 / math.sqrt(n - 3)
        out["r_ci_lo"], out["r_ci_hi"] = math.tanh(z - half), math.tanh(z + half)
    elif abs(r) >= 1:
        out["r_ci_lo"] = out["r_ci_hi"] = float(r)
    rho, rho_p = sps.spearmanr(x, y)
    out["rho"], out["rho_p"] = float(rho), float(rho_p)
    return out


def wilson_ci(successes: int, n: int, level: float = 0.95) -> tuple[float | None, float | None]:
    """Wilson score interval for a binomial proportion."""
    if n <= 0:
        return None, None
    z = float(sps.norm.ppf(1 - (1 - level) / 2))
    p = successes / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def median_ci(values: np.ndarray, level: float = 0.95) -> tuple[float | None, float | None]:
    """Distribution-free CI of the median from binomial order statistics."""
    v = np.sort(np.asarray(values, dtype=float))
    n = v.size
    if n == 0:
        return None, None
    lo = int(sps.binom.ppf((1 - level) / 2, n, 0.5))
    hi = int(sps.binom.isf((1 - level) / 2, n, 0.5))
    return float(v[max(lo - 1, 0)]), float(v[min(hi, n - 1)])


def pareto_front(cost: Sequence[float], loss: Sequence[float]) -> np.ndarray:
    """bool mask: points no other point beats on both (<= both, < one); NaN points never are."""
    c = np.asarray(cost, dtype=float)
    q = np.asarray(loss, dtype=float)
    ok = np.isfinite(c) & np.isfinite(q)
    front = ok.copy()
    for i in np.flatnonzero(ok):
        dominated = ok & (c <= c[i]) & (q <= q[i]) & ((c < c[i]) | (q < q[i]))
        front[i] = not dominated.any()
    return front


def dppl_pct(mean_dnll: np.ndarray | float) -> np.ndarray | float:
    """Δppl % from the mean per-token ΔNLL: 100 * (exp(mean ΔNLL) - 1)."""
    return 100.0 * np.expm1(mean_dnll)


# ----------------------------------------------------------------------------------------------
# the analysis


def _sql_list(paths: Sequence[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def _none_if_nan(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return None if not np.isfinite(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, dict):
        return {k: _none_if_nan(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_none_if_nan(x) for x in v]
    return v


def _missing(reason: str) -> dict[str, Any]:
    return {"status": "missing", "reason": reason}


class _Analysis:
    """State shared by the parts: the DuckDB connection, file infos, params, results."""

    def __init__(self, inputs: dict[str, list[str]], params: AnalysisParams):
        self.inputs = inputs
        self.p = params
        self.con = duckdb.connect()
        self.con.execute("SET threads TO 2").fetchall()
        self.infos = {k: [file_info(f, k) for f in inputs[k]] for k in DATA_KINDS}
        self.parts: dict[str, dict[str, Any]] = {}
        self.tables: dict[str, pd.DataFrame] = {}
        self.results: dict[str, Any] = {}
        self._check_duplicates()

    # ---- loading -------------------------------------------------------------------------------

    def _check_duplicates(self) -> None:
        for kind in ("simulate", "emulate", "engine"):
            seen: dict[tuple, str] = {}
            for info in self.infos[kind]:
                key = (info.name, info.fraction, info.device)
                if key in seen:
                    raise ValueError(
                        f"inputs[{kind!r}]: {seen[key]!r} and {info.path!r} are the same run "
                        f"(policy {info.name!r}, fraction {info.fraction}): one model per analysis"
                    )
                seen[key] = info.path
        seen = {}
        for info in self.infos["expb"]:
            key = (info.condition, info.target_mass)
            if key in seen:
                raise ValueError(
                    f"inputs['expb']: {seen[key]!r} and {info.path!r} are the same run"
                )
            seen[key] = info.path

    def policy(self, name: str, info: FileInfo | None = None) -> dict[str, Any] | None:
        if name in self.p.policies:
            return self.p.policies[name]
        meta_p = info.meta.get("policy") if info is not None else None
        if isinstance(meta_p, Mapping):
            return normalize_policy(name, dict(meta_p))
        return None

    def _register_files(self, kind: str) -> str:
        rows = [
            {
                "filename": i.path,
                "name": i.name,
                "fraction": i.fraction,
                "device": i.device,
                "condition": i.condition,
                "target_mass": i.target_mass,
            }
            for i in self.infos[kind]
        ]
        table = f"files_{kind}"
        self.con.register(table, pd.DataFrame(rows))
        return table

    def _load_tables(self) -> None:
        con = self.con
        if self.inputs["capture_tokens"]:
            con.execute(
                "CREATE TEMP TABLE cap AS SELECT stream, pos, doc_id, doc_start, nll "
                f"FROM read_parquet({_sql_list(self.inputs['capture_tokens'])})"
            ).fetchall()
            dup = con.execute(
                "SELECT count(*) - count(DISTINCT (stream, pos)) FROM cap"
            ).fetchall()[0][0]
            if dup:
                raise ValueError(
                    f"inputs['capture_tokens']: {dup} duplicate (stream, pos) rows across "
                    f"{self.inputs['capture_tokens']}: pass one split of one model"
                )
        if self.inputs["emulate"]:
            files = self._register_files("emulate")
            con.execute(
                "CREATE TEMP TABLE emu AS SELECT f.name, f.fraction, t.stream, t.pos, t.doc_id, "
                't.doc_start, t.nll, t.mass, t.hit, t."fetch", t.sub, t.host, t.forced '
                f"FROM read_parquet({_sql_list(self.inputs['emulate'])}, filename=true, "
                f"union_by_name=true) t JOIN {files} f USING (filename)"
            ).fetchall()
            self._emulate_baseline()

    def _emulate_baseline(self) -> None:
        """emu_base(fraction, stream, pos, nll_b): the baseline's NLL at every fraction."""
        con, base = self.con, self.p.baseline
        con.execute(
            "CREATE TEMP TABLE emu_base AS SELECT fraction, stream, pos, nll AS nll_b "
            "FROM emu WHERE name = ?",
            [base],
        ).fetchall()
        fractions = [r[0] for r in con.execute("SELECT DISTINCT fraction FROM emu").fetchall()]
        have = {r[0] for r in con.execute("SELECT DISTINCT fraction FROM emu_base").fetchall()}
        self.results["dppl_base"] = {}
        for frac in sorted(fractions):
            if frac in have:
                self.results["dppl_base"][str(frac)] = f"{base} (emulated)"
            elif self.inputs["capture_tokens"]:
                con.execute(
                    "INSERT INTO emu_base SELECT ?, stream, pos, nll FROM cap", [frac]
                ).fetchall()
                self.results["dppl_base"][str(frac)] = "captured exact NLL"
            else:
                self.results["dppl_base"][str(frac)] = "none"

    # ---- parts ---------------------------------------------------------------------------------

    def run(self) -> None:
        self._load_tables()
        self.quality()
        self.mass_hypothesis()
        self.per_input()
        self.experiment_b()
        self.admission()
        self.simulate_tables()
        self.engine_tables()
        self.generation()
        self.summary()

    def quality(self) -> None:
        """Per-stream aggregates of emulate vs the baseline, and per-policy totals with CIs."""
        if not self.inputs["emulate"]:
            self.parts["quality"] = _missing("no emulate artefacts")
            self.tables["emu_streams"] = pd.DataFrame()
            self.tables["quality"] = pd.DataFrame()
            return
        ps = self.con.execute(
            """
            SELECT e.name, e.fraction, e.stream,
                   count(*) AS n_tok, sum(e.mass) AS sum_mass,
                   count(e.nll - b.nll_b) AS n_nll,
                   coalesce(sum(e.nll - b.nll_b), 0) AS sum_dnll,
                   coalesce(sum(CASE WHEN b.nll_b IS NOT NULL THEN e.nll END), 0) AS sum_nll,
                   coalesce(sum(CASE WHEN e.nll IS NOT NULL THEN b.nll_b END), 0) AS sum_nll_b,
                   count(e.nll) AS n_nll_own, coalesce(sum(e.nll), 0) AS sum_nll_own,
                   sum(e.hit) AS hit, sum(e."fetch") AS "fetch", sum(e.sub) AS sub,
                   sum(e.host) AS host, sum(e.forced) AS forced
            FROM emu e LEFT JOIN emu_base b
              ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
            GROUP BY ALL ORDER BY e.name, e.fraction, e.stream
            """
        ).df()
        self.tables["emu_streams"] = ps
        rows = []
        for (name, frac), g in ps.groupby(["name", "fraction"], sort=True):
            streams = g["stream"].to_numpy()
            w = boot_counts(len(streams), self.p.n_boot, _rng(self.p.seed, "quality", name, frac))
            n_tok, n_nll = g["n_tok"].to_numpy(float), g["n_nll"].to_numpy(float)
            sum_mass, sum_dnll = g["sum_mass"].to_numpy(float), g["sum_dnll"].to_numpy(float)
            calls = float(sum(g[c].sum() for c in COUNT_COLS))
            with np.errstate(invalid="ignore", divide="ignore"):
                mass_b = (w @ sum_mass) / (w @ n_tok)
                dppl_b = dppl_pct((w @ sum_dnll) / (w @ n_nll))
            has_base = n_nll.sum() > 0
            nll_n = n_nll.sum() if has_base else g["n_nll_own"].sum()
            nll_sum = g["sum_nll"].sum() if has_base else g["sum_nll_own"].sum()
            row = {
                "policy": name,
                "fraction": float(frac),
                "n_streams": len(streams),
                "n_tokens": int(n_tok.sum()),
                "n_nll_tokens": int(nll_n),
                "ppl": math.exp(nll_sum / nll_n) if nll_n else None,
                "ppl_base": math.exp(g["sum_nll_b"].sum() / nll_n) if has_base else None,
                "dppl_pct": float(dppl_pct(sum_dnll.sum() / n_nll.sum())) if has_base else None,
                "mass_mean": float(sum_mass.sum() / n_tok.sum()),
                "sub_rate": float(g["sub"].sum() / calls) if calls else None,
                "hit_rate": float(g["hit"].sum() / calls) if calls else None,
                "forced_rate": float(g["forced"].sum() / calls) if calls else None,
            }
            row["dppl_ci_lo"], row["dppl_ci_hi"] = (
                percentile_ci(dppl_b, self.p.ci_level) if has_base else (None, None)
            )
            row["mass_ci_lo"], row["mass_ci_hi"] = percentile_ci(mass_b, self.p.ci_level)
            rows.append(row)
        self.tables["quality"] = pd.DataFrame(rows)
        no_base = [f for f, s in self.results["dppl_base"].items() if s == "none"]
        self.parts["quality"] = (
            {"status": "ok"}
            if not no_base
            else {
                "status": "partial",
                "reason": f"no {self.p.baseline} run and no capture tokens at fraction(s) "
                f"{no_base}: Δppl undefined there",
            }
        )

    def mass_hypothesis(self) -> None:
        ps = self.tables["emu_streams"]
        if ps.empty or not (ps["n_nll"] > 0).any():
            self.parts["mass_hypothesis"] = _missing(
                "needs emulate artefacts and a baseline NLL (fetch_every_miss or capture)"
            )
            self.tables["mass_points"] = pd.DataFrame()
            self.results["mass_hypothesis"] = []
            return
        groups = {
            "fetches first choice": FETCH_FIRST_RULES,
            "substitutes first choice": SUBSTITUTE_FIRST_RULES,
        }
        info_by_name = {i.name: i for i in self.infos["emulate"]}
        points, results = [], []
        for frac, gf in ps.groupby("fraction", sort=True):
            streams = np.sort(gf["stream"].unique())
            w = boot_counts(len(streams), self.p.n_boot, _rng(self.p.seed, "mass", frac))
            for group, rules in groups.items():
                names = []
                for name in sorted(gf["name"].unique()):
                    pol = self.policy(name, info_by_name.get(name))
                    if pol is not None and pol["rule"] in rules:
                        names.append(name)
                if not names:
                    continue  # no policy of this kind ran at this fraction
                # (P, S) per-stream sums; streams a policy lacks contribute nothing to it
                mats = {
                    c: gf.pivot_table(index="name", columns="stream", values=c, aggfunc="sum")
                    .reindex(index=names, columns=streams)
                    .fillna(0.0)
                    .to_numpy(float)
                    for c in ("n_tok", "sum_mass", "n_nll", "sum_dnll")
                }
                with np.errstate(invalid="ignore", divide="ignore"):
                    mass = mats["sum_mass"].sum(1) / mats["n_tok"].sum(1)
                    dppl = dppl_pct(mats["sum_dnll"].sum(1) / mats["n_nll"].sum(1))
                    mass_b = (w @ mats["sum_mass"].T) / (w @ mats["n_tok"].T)  # (B, P)
                    dppl_b = dppl_pct((w @ mats["sum_dnll"].T) / (w @ mats["n_nll"].T))
                corr = correlation(mass, dppl)
                res = {"fraction": float(frac), "group": group, "policies": names, **corr}
                res["n_boot"] = self.p.n_boot
                res["ci_lo"] = res["ci_hi"] = None
                res["n_boot_valid"] = 0
                if corr["r"] is not None:
                    r_b = rowwise_pearson(mass_b, dppl_b)
                    res["n_boot_valid"] = int(np.isfinite(r_b).sum())
                    res["ci_lo"], res["ci_hi"] = percentile_ci(r_b, self.p.ci_level)
                results.append(res)
                for name, m, d in zip(names, mass, dppl, strict=True):
                    points.append(
                        {
                            "fraction": float(frac),
                            "group": group,
                            "policy": name,
                            "mass_mean": float(m),
                            "dppl_pct": float(d),
                        }
                    )
        self.tables["mass_points"] = pd.DataFrame(points)
        self.results["mass_hypothesis"] = results
        self.parts["mass_hypothesis"] = {"status": "ok"}

    def per_input(self) -> None:
        ps = self.tables["emu_streams"]
        if ps.empty or not (ps["n_nll"] > 0).any():
            self.parts["per_input"] = _missing("needs emulate artefacts and a baseline NLL")
            self.tables["per_input"] = self.tables["per_input_points"] = pd.DataFrame()
            return
        docs = self.con.execute(
            """
            SELECT e.name, e.fraction, e.doc_id AS unit,
                   avg(e.mass) AS mass_mean, avg(e.nll - b.nll_b) AS dnll_mean,
                   count(e.nll - b.nll_b) AS n_nll
            FROM emu e JOIN emu_base b
              ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
            GROUP BY ALL
            """
        ).df()
        docs["level"] = "document"
        streams = ps.assign(
            unit=ps["stream"],
            mass_mean=ps["sum_mass"] / ps["n_tok"],
            dnll_mean=ps["sum_dnll"] / ps["n_nll"].where(ps["n_nll"] > 0),
            level="stream",
        )[["name", "fraction", "unit", "mass_mean", "dnll_mean", "n_nll", "level"]]
        pts = pd.concat([streams, docs[streams.columns]], ignore_index=True)
        pts = pts[pts["n_nll"] > 0].rename(columns={"name": "policy"})
        pts = pts.sort_values(["policy", "fraction", "level", "unit"], ignore_index=True)
        rows = []
        for (name, frac, level), g in pts.groupby(["policy", "fraction", "level"], sort=True):
            if name == self.p.baseline:
                continue
            corr = correlation(g["mass_mean"], g["dnll_mean"])
            rows.append({"policy": name, "fraction": float(frac), "level": level, **corr})
        self.tables["per_input_points"] = pts
        self.tables["per_input"] = pd.DataFrame(rows)
        self.parts["per_input"] = {"status": "ok"}

    def experiment_b(self) -> None:
        self.tables["expb"] = pd.DataFrame()
        self.results["expb"] = None
        if not self.inputs["expb"]:
            self.parts["expb"] = _missing("no Experiment B artefacts")
            return
        if not self.inputs["capture_tokens"]:
            self.parts["expb"] = _missing("Experiment B needs the captured exact NLL (capture)")
            return
        if self.p.expb is None:
            self.parts["expb"] = _missing("no decision rule in params['expb']")
            return
        files = self._register_files("expb")
        per = self.con.execute(
            f"""
            SELECT f.condition, f.target_mass, t.stream,
                   -- m* is a mass per token-layer: count token-layers, not tokens
                   sum(len(t.layer_mass)) AS n_tok, sum(t.mass) AS sum_mass,
                   sum(t.n_sub) AS n_sub,
                   count(t.nll - c.nll) AS n_nll, coalesce(sum(t.nll - c.nll), 0) AS sum_dnll
            FROM read_parquet({_sql_list(self.inputs["expb"])}, filename=true) t
            JOIN {files} f USING (filename)
            LEFT JOIN cap c ON t.stream = c.stream AND t.pos = c.pos
            GROUP BY ALL ORDER BY f.target_mass, t.stream, f.condition
            """
        ).df()
        rule = self.p.expb
        stream_rows, targets = [], []
        for target, g in per.groupby("target_mass", sort=True):
            res, rows = expb_test(g, float(target), rule)
            res["primary"] = bool(math.isclose(target, rule.primary, rel_tol=1e-9))
            targets.append(res)
            stream_rows.extend(rows)
        primary = [t for t in targets if t["primary"]]
        if primary:
            decision = dict(primary[0])
        else:
            decision = {
                "target_mass": rule.primary,
                "outcome": "inconclusive",
                "outcome_text": f"inconclusive (no heavy and light runs at m* = {rule.primary:g}; "
                f"targets run: {[t['target_mass'] for t in targets]})",
            }
        decision["rule"] = asdict(rule)
        self.results["expb"] = {"decision": decision, "targets": targets}
        self.tables["expb"] = pd.DataFrame(stream_rows)
        self.parts["expb"] = {"status": "ok"}

    def admission(self) -> None:
        self.tables["admission"] = pd.DataFrame()
        self.results["admission"] = []
        if not self.inputs["emulate"]:
            self.parts["admission"] = _missing("no emulate artefacts")
            return
        info_by_name = {i.name: i for i in self.infos["emulate"]}
        runs = self.con.execute(
            "SELECT DISTINCT name, fraction FROM emu ORDER BY name, fraction"
        ).fetchall()
        present: dict[float, list[str]] = {}
        for name, frac in runs:
            present.setdefault(frac, []).append(name)
        edges = np.asarray(self.p.admission_bins, dtype=np.int64)
        labels = [(f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}") for lo, hi in pairwise(edges)] + [
            f"{edges[-1]}+"
        ]
        rows, totals, skipped = [], [], []
        for frac, names in sorted(present.items()):
            for name in names:
                pol = self.policy(name, info_by_name.get(name))
                if pol is None or pol["beta"] <= 0:
                    continue
                twin, exact = find_twin(
                    pol, {n: self.policy(n, info_by_name.get(n)) for n in names if n != name}
                )
                if twin is None:
                    skipped.append(f"{name} @ f{frac:g}: no beta=0 policy with rule {pol['rule']}")
                    continue
                r, t = self._admission_pair(name, twin, frac, edges, labels)
                for row in r:
                    row["twin_exact"] = exact
                t["twin_exact"] = exact
                rows.extend(r)
                totals.append(t)
        self.tables["admission"] = pd.DataFrame(rows)
        self.results["admission"] = totals
        if totals:
            self.parts["admission"] = {"status": "ok"}
            if skipped:
                self.parts["admission"]["note"] = "; ".join(skipped)
        else:
            self.parts["admission"] = _missing(
                "no admission policy (beta > 0) with a no-admission twin among emulate runs"
                + (f" ({'; '.join(skipped)})" if skipped else "")
            )

    def _admission_pair(self, name, twin, frac, edges, labels):
        tok = self.con.execute(
            """
            WITH a AS (
              SELECT stream, pos, nll,
                     sum(CASE WHEN doc_start THEN 1 ELSE 0 END) OVER
                       (PARTITION BY stream ORDER BY pos ROWS UNBOUNDED PRECEDING) AS seg
              FROM emu WHERE name = $name AND fraction = $frac),
            s AS (SELECT *, pos - min(pos) OVER (PARTITION BY stream, seg) AS since FROM a)
            SELECT s.stream, s.since, s.nll - t.nll AS dnll
            FROM s JOIN emu t
              ON t.name = $twin AND t.fraction = $frac AND t.stream = s.stream AND t.pos = s.pos
            WHERE s.nll IS NOT NULL AND t.nll IS NOT NULL
            ORDER BY s.stream, s.pos
            """,
            {"name": name, "twin": twin, "frac": frac},
        ).fetchnumpy()
        streams, s_idx = np.unique(tok["stream"], return_inverse=True)
        b_idx = np.searchsorted(edges, tok["since"], side="right") - 1
        n_s, n_b = len(streams), len(edges)
        flat = s_idx * n_b + b_idx
        sums = np.bincount(flat, tok["dnll"], n_s * n_b).reshape(n_s, n_b)  # (S, bins)
        cnts = np.bincount(flat, None, n_s * n_b).reshape(n_s, n_b).astype(float)
        w = boot_counts(n_s, self.p.n_boot, _rng(self.p.seed, "admission", name, frac))
        with np.errstate(invalid="ignore", divide="ignore"):
            boot = (w @ sums) / (w @ cnts)  # (B, bins)
            tot_b = dppl_pct((w @ sums.sum(1)) / (w @ cnts.sum(1)))
        rows = []
        for b in range(n_b):
            n = int(cnts[:, b].sum())
            if n == 0:
                continue
            lo, hi = percentile_ci(boot[:, b], self.p.ci_level)
            rows.append(
                {
                    "policy": name,
                    "twin": twin,
                    "fraction": float(frac),
                    "bin": b,
                    "bin_lo": int(edges[b]),
                    "bin_label": labels[b],
                    "n_tokens": n,
                    "n_streams": int((cnts[:, b] > 0).sum()),
                    "dnll_mean": float(sums[:, b].sum() / n),
                    "ci_lo": lo,
                    "ci_hi": hi,
                }
            )
        n_all = int(cnts.sum())
        lo, hi = percentile_ci(tot_b, self.p.ci_level)
        total = {
            "policy": name,
            "twin": twin,
            "fraction": float(frac),
            "n_tokens": n_all,
            "n_streams": n_s,
            "dnll_mean": float(sums.sum() / n_all) if n_all else None,
            "dppl_pct_vs_twin": float(dppl_pct(sums.sum() / n_all)) if n_all else None,
            "ci_lo": lo,
            "ci_hi": hi,
        }
        return rows, total

    def simulate_tables(self) -> None:
        self.tables["sim_total"] = self.tables["layer_hit_rates"] = pd.DataFrame()
        if not self.inputs["simulate"]:
            self.parts["simulate"] = _missing("no simulate artefacts")
            return
        files = self._register_files("simulate")
        sim = self.con.execute(
            f"""
            SELECT f.name AS policy, f.fraction, t.layer, t.tokens, t.hit, t."fetch", t.sub,
                   t.host, t.forced, t.admissions, t.evictions, t.hit_rate, t.sub_rate,
                   t.mass_mean, t.est_time_per_token_s, t.belady_hit_rate
            FROM read_parquet({_sql_list(self.inputs["simulate"])}, filename=true,
                              union_by_name=true) t
            JOIN {files} f USING (filename) ORDER BY policy, fraction, layer
            """
        ).df()
        self.tables["sim_total"] = sim[sim["layer"] == -1].reset_index(drop=True)
        self.tables["layer_hit_rates"] = sim[sim["layer"] >= 0][
            ["policy", "fraction", "layer", "tokens", "hit_rate", "sub_rate", "mass_mean"]
        ].reset_index(drop=True)
        self.parts["simulate"] = {"status": "ok"}

    def engine_tables(self) -> None:
        self.tables["engine"] = self.tables["sim_vs_engine"] = pd.DataFrame()
        if not self.inputs["engine"]:
            self.parts["engine"] = _missing("no engine artefacts")
        else:
            self._engine_per_run()
        self._speed_quality()
        self._sim_vs_engine()

    def _engine_per_run(self) -> None:
        files = self._register_files("engine")
        tok = self.con.execute(
            f"""
            SELECT f.name, f.fraction, f.device, t.wall_s, t.fetch_wait_s, t.nll
            FROM read_parquet({_sql_list(self.inputs["engine"])}, filename=true,
                              union_by_name=true) t
            JOIN {files} f USING (filename) ORDER BY f.name, f.fraction, f.device
            """
        ).df()
        tiers = {(i.name, i.fraction, i.device): i.meta.get("tier") for i in self.infos["engine"]}
        rows = []
        for (name, frac, dev), g in tok.groupby(["name", "fraction", "device"], sort=True):
            wall = g["wall_s"].to_numpy(float)
            lo, hi = median_ci(wall, self.p.ci_level)
            nll = g["nll"].dropna().to_numpy(float)
            rows.append(
                {
                    "policy": name,
                    "fraction": float(frac),
                    "device": dev,
                    "tier": tiers.get((name, frac, dev)),
                    "n_tokens": len(wall),
                    "time_per_token_s": float(np.median(wall)),
                    "time_ci_lo": lo,
                    "time_ci_hi": hi,
                    "time_mean_s": float(wall.mean()),
                    "time_p90_s": float(np.quantile(wall, 0.9)),
                    "fetch_wait_mean_s": float(g["fetch_wait_s"].mean()),
                    "engine_ppl": float(math.exp(nll.mean())) if nll.size else None,
                }
            )
        eng = pd.DataFrame(rows)
        for ref, col in (
            (self.p.baseline, "speedup_vs_fetch_every_miss"),
            (self.p.host_baseline, "speedup_vs_host_compute"),
        ):
            base = eng[eng["policy"] == ref].set_index(["fraction", "device"])["time_per_token_s"]
            keys = list(zip(eng["fraction"], eng["device"], strict=True))
            eng[col] = [
                base.get(k, np.nan) / t if t > 0 else np.nan
                for k, t in zip(keys, eng["time_per_token_s"], strict=True)
            ]
        self.tables["engine"] = eng
        self.parts["engine"] = {"status": "ok"}

    def _speed_quality(self) -> None:
        q = self.tables["quality"]
        eng, sim = self.tables["engine"], self.tables["sim_total"]
        frames = []
        if not eng.empty:
            frames.append(
                eng.assign(source="engine")[
                    [
                        "policy",
                        "fraction",
                        "device",
                        "source",
                        "time_per_token_s",
                        "time_ci_lo",
                        "time_ci_hi",
                        "speedup_vs_fetch_every_miss",
                        "speedup_vs_host_compute",
                    ]
                ]
            )
        if not sim.empty:
            s = sim.assign(
                device="simulated", source="simulate", time_per_token_s=sim["est_time_per_token_s"]
            )
            for ref, col in (
                (self.p.baseline, "speedup_vs_fetch_every_miss"),
                (self.p.host_baseline, "speedup_vs_host_compute"),
            ):
                base = s[s["policy"] == ref].set_index("fraction")["time_per_token_s"]
                s[col] = s["fraction"].map(base) / s["time_per_token_s"]
            frames.append(
                s[
                    [
                        "policy",
                        "fraction",
                        "device",
                        "source",
                        "time_per_token_s",
                        "speedup_vs_fetch_every_miss",
                        "speedup_vs_host_compute",
                    ]
                ]
            )
        if not frames or q.empty:
            self.tables["speed_quality"] = pd.DataFrame()
            self.parts["speed_quality"] = _missing(
                "needs emulate (Δppl) and engine or simulate (time per token)"
            )
            return
        sq = pd.concat(frames, ignore_index=True).merge(
            q[["policy", "fraction", "dppl_pct", "dppl_ci_lo", "dppl_ci_hi"]],
            on=["policy", "fraction"],
            how="inner",
        )
        sq["frontier"] = False
        for _, idx in sq.groupby(["fraction", "device"]).groups.items():
            sq.loc[idx, "frontier"] = pareto_front(
                sq.loc[idx, "time_per_token_s"], sq.loc[idx, "dppl_pct"]
            )
        self.tables["speed_quality"] = sq.sort_values(
            ["source", "device", "fraction", "time_per_token_s"], ignore_index=True
        )
        self.parts["speed_quality"] = {"status": "ok"}

    def _sim_vs_engine(self) -> None:
        eng, sim = self.tables["engine"], self.tables["sim_total"]
        self.results["sim_vs_engine"] = None
        if eng.empty or sim.empty:
            self.tables["sim_vs_engine"] = pd.DataFrame()
            self.parts["sim_vs_engine"] = _missing("needs both simulate and engine artefacts")
            return
        j = eng[["policy", "fraction", "device", "n_tokens", "time_mean_s", "time_per_token_s"]]
        j = j.merge(sim[["policy", "fraction", "est_time_per_token_s"]], on=["policy", "fraction"])
        j["rel_error"] = j["est_time_per_token_s"] / j["time_mean_s"] - 1.0
        self.tables["sim_vs_engine"] = j
        if j.empty:
            self.parts["sim_vs_engine"] = _missing(
                "no policy/fraction run in both simulate and engine"
            )
            return
        err = j["rel_error"].abs().to_numpy()
        self.results["sim_vs_engine"] = {
            "n": len(j),
            "median_abs_rel_error": float(np.median(err)),
            "max_abs_rel_error": float(err.max()),
            "r": correlation(j["est_time_per_token_s"], j["time_mean_s"])["r"],
        }
        self.parts["sim_vs_engine"] = {"status": "ok"}

    def generation(self) -> None:
        self.tables["generation"] = pd.DataFrame()
        if not self.inputs["generate"]:
            self.parts["generation"] = _missing("no generation artefacts")
            return
        gen = self.con.execute(
            f"""
            SELECT task, policy, fraction, problem_id, correct, agree_exact,
                   agree_prefix_frac, mass_mean, n_tokens
            FROM read_parquet({_sql_list(self.inputs["generate"])}, union_by_name=true)
            ORDER BY task, policy, fraction, problem_id
            """
        ).df()
        missing = {
            (str(i.meta.get("task")), str(i.meta.get("name"))): str(i.meta["missing_data"])
            for i in self.infos["generate"]
            if i.meta.get("missing_data")
        }
        notes = [f"{t}/{n}: {m}" for (t, n), m in sorted(missing.items())]
        if gen.empty:
            why = "; ".join(sorted(set(missing.values())))
            self.parts["generation"] = _missing(
                "generation artefacts hold no problems" + (f" ({why})" if why else "")
            )
            return
        rows = []
        level = self.p.ci_level
        for (task, name, frac), g in gen.groupby(["task", "policy", "fraction"], sort=True):
            n = len(g)
            k = int(g["correct"].sum())
            a = int(g["agree_exact"].sum())
            row = {
                "task": task,
                "policy": name,
                "fraction": float(frac),
                "n": n,
                "n_correct": k,
                "accuracy": k / n,
                "n_agree": a,
                "agree_exact": a / n,
                "agree_prefix_mean": float(g["agree_prefix_frac"].mean()),
                "mass_mean": float(g["mass_mean"].mean()),
                "tokens_mean": float(g["n_tokens"].mean()),
            }
            row["acc_ci_lo"], row["acc_ci_hi"] = wilson_ci(k, n, level)
            row["agree_ci_lo"], row["agree_ci_hi"] = wilson_ci(a, n, level)
            corr = correlation(g["mass_mean"], g["agree_prefix_frac"])
            row.update(
                {
                    "mass_agree_n": corr["n"],
                    "mass_agree_rho": corr["rho"],
                    "mass_agree_p": corr["rho_p"],
                    "mass_agree_reason": corr["reason"],
                }
            )
            rows.append(row)
        self.tables["generation"] = pd.DataFrame(rows)
        self.parts["generation"] = {"status": "ok"}
        if notes:
            self.parts["generation"]["note"] = "missing data: " + "; ".join(notes)

    def summary(self) -> None:
        keys = []
        for t in ("quality", "sim_total", "engine"):
            df = self.tables[t]
            if not df.empty:
                keys.append(df[["policy", "fraction"]])
        gen = self.tables["generation"]
        if not gen.empty:
            keys.append(gen[["policy", "fraction"]])
        if not keys:
            self.tables["summary"] = pd.DataFrame()
            self.parts["summary"] = _missing("no per-policy artefacts at all")
            return
        s = pd.concat(keys).drop_duplicates().sort_values(["fraction", "policy"])
        s = s.reset_index(drop=True)
        pols = [self.policy(n) or {} for n in s["policy"]]
        for key in ("rule", "tau", "eviction", "beta"):
            s[key] = [p.get(key) for p in pols]
        if not self.tables["quality"].empty:
            s = s.merge(self.tables["quality"], on=["policy", "fraction"], how="left")
        sim = self.tables["sim_total"]
        if not sim.empty:
            s = s.merge(
                sim[["policy", "fraction", "hit_rate", "sub_rate", "est_time_per_token_s"]].rename(
                    columns={
                        "hit_rate": "sim_hit_rate",
                        "sub_rate": "sim_sub_rate",
                        "est_time_per_token_s": "sim_time_per_token_s",
                    }
                ),
                on=["policy", "fraction"],
                how="left",
            )
        eng = self.tables["engine"]
        if not eng.empty:
            # one device per summary row: a CUDA device if one ran, else the first by name
            order = eng.assign(_cuda=~eng["device"].astype(str).str.startswith("cuda"))
            first = order.sort_values(["_cuda", "device"]).drop_duplicates(["policy", "fraction"])
            s = s.merge(
                first[
                    [
                        "policy",
                        "fraction",
                        "device",
                        "time_per_token_s",
                        "speedup_vs_fetch_every_miss",
                        "speedup_vs_host_compute",
                    ]
                ].rename(columns={"device": "engine_device"}),
                on=["policy", "fraction"],
                how="left",
            )
        if not gen.empty:
            for task in sorted(gen["task"].unique()):
                g = gen[gen["task"] == task][
                    ["policy", "fraction", "accuracy", "acc_ci_lo", "acc_ci_hi", "n", "agree_exact"]
                ].rename(
                    columns={
                        c: f"{task}_{c}"
                        for c in ("accuracy", "acc_ci_lo", "acc_ci_hi", "n", "agree_exact")
                    }
                )
                s = s.merge(g, on=["policy", "fraction"], how="left")
        self.tables["summary"] = s
        self.parts["summary"] = {"status": "ok"}

    # ---- output --------------------------------------------------------------------------------

    def provenance(self) -> list[dict[str, Any]]:
        out = []
        for kind in DATA_KINDS:
            for info in self.infos[kind]:
                meta = {k: info.meta[k] for k in PROVENANCE_KEYS if k in info.meta}
                out.append({"kind": kind, "path": info.path, "rows": info.rows, "metadata": meta})
        for kind in EXTRA_KINDS:
            for path in self.inputs[kind]:
                out.append({"kind": kind, "path": path, "rows": None, "metadata": {}})
        return out


def expb_test(per: pd.DataFrame, target: float, rule: ExpBRule) -> tuple[dict, list[dict]]:
    """Experiment B at one target mass.

    `per`: one row per (condition, stream) with n_tok, sum_mass, n_nll, sum_dnll (ΔNLL vs the
    captured exact NLL). Returns the decision dict and the per-stream rows.
    """
    res: dict[str, Any] = {"target_mass": target, "alpha": rule.alpha}
    conds = {c: g.set_index("stream") for c, g in per.groupby("condition")}
    if set(conds) != {"heavy", "light"}:
        res.update(
            outcome="inconclusive",
            outcome_text=f"inconclusive (only {sorted(conds)} ran at m = {target:g})",
        )
        return res, []
    h, light = conds["heavy"], conds["light"]
    m_h = float(h["sum_mass"].sum() / h["n_tok"].sum())
    m_l = float(light["sum_mass"].sum() / light["n_tok"].sum())
    gap = abs(m_h - m_l) / min(m_h, m_l) if min(m_h, m_l) > 0 else math.inf
    res.update(
        realized_heavy=m_h,
        realized_light=m_l,
        heavy_fraction_of_target=m_h / target,
        relative_gap=gap,
    )
    streams = h.index.intersection(light.index).sort_values()
    hs, ls = h.loc[streams], light.loc[streams]
    with np.errstate(invalid="ignore", divide="ignore"):
        mh, ml = hs["sum_mass"] / hs["n_tok"], ls["sum_mass"] / ls["n_tok"]
        dh, dl = hs["sum_dnll"] / hs["n_nll"], ls["sum_dnll"] / ls["n_nll"]
        d = dh / mh - dl / ml
    usable = np.isfinite(d.to_numpy(float))
    rows = [
        {
            "target_mass": target,
            "stream": int(s),
            "mass_heavy": float(mh[s]),
            "mass_light": float(ml[s]),
            "dnll_heavy": float(dh[s]),
            "dnll_light": float(dl[s]),
            "d_per_mass": float(d[s]),
            "usable": bool(u),
        }
        for s, u in zip(streams, usable, strict=True)
    ]
    d_ok = d.to_numpy(float)[usable]
    res.update(
        n_streams=len(streams),
        n_used=int(d_ok.size),
        n_dropped=int(len(streams) - d_ok.size),
        median_d=float(np.median(d_ok)) if d_ok.size else None,
        mean_d=float(d_ok.mean()) if d_ok.size else None,
    )
    valid_mass = m_h >= rule.min_heavy_fraction * target
    valid_gap = gap <= rule.max_gap
    res["valid"] = bool(valid_mass and valid_gap)
    masses = (
        f"heavy {m_h:.4g} = {100 * m_h / target:.0f}% of m* {target:g} "
        f"(needs >= {100 * rule.min_heavy_fraction:.0f}%), light {m_l:.4g}, "
        f"gap {100 * gap:.1f}% (needs <= {100 * rule.max_gap:.0f}%)"
    )
    if not res["valid"]:
        res.update(
            outcome="inconclusive", p=None, outcome_text=f"inconclusive (realized mass {masses})"
        )
        return res, rows
    nonzero = int((d_ok != 0).sum())
    res["min_attainable_p"] = 0.5**nonzero if nonzero else 1.0
    if nonzero == 0:
        p, stat = 1.0, 0.0
    else:
        test = sps.wilcoxon(d_ok, alternative="greater")
        p, stat = float(test.pvalue), float(test.statistic)
    res.update(p=p, statistic=stat)
    worse = p < rule.alpha
    detail = (
        f"Wilcoxon signed-rank one-sided p = {p:.3g} {'<' if worse else '>='} alpha "
        f"{rule.alpha:g}, n = {d_ok.size} streams, median ΔNLL difference per unit mass "
        f"{res['median_d']:.4g}; realized mass {masses}"
    )
    if worse:
        res.update(outcome="heavy worse", outcome_text=f"heavy worse ({detail})")
    else:
        note = (
            f"; with {nonzero} non-zero differences p cannot go below {res['min_attainable_p']:.3g}"
            if res["min_attainable_p"] >= rule.alpha
            else ""
        )
        res.update(outcome="no evidence", outcome_text=f"no evidence ({detail}{note})")
    return res, rows


def find_twin(
    policy: Mapping[str, Any], candidates: Mapping[str, Mapping[str, Any] | None]
) -> tuple[str | None, bool]:
    """The no-admission twin of an admission policy among `candidates` (name -> policy dict).

    Same rule (and tau for `threshold`), beta 0; the same eviction if present (exact twin),
    else `lru`, else the first by name. Returns (name or None, exact).
    """

    def same_rule(c: Mapping[str, Any]) -> bool:
        if c["rule"] != policy["rule"] or c["beta"] > 0:
            return False
        return policy["rule"] != "threshold" or math.isclose(c["tau"], policy["tau"])

    pool = sorted(n for n, c in candidates.items() if c is not None and same_rule(c))
    if not pool:
        return None, False
    for n in pool:
        if candidates[n]["eviction"] == policy["eviction"]:
            return n, True
    for n in pool:
        if candidates[n]["eviction"] == "lru":
            return n, False
    return pool[0], False


def _write(df: pd.DataFrame, path: Path) -> None:
    write_parquet(df.reset_index(drop=True) if not df.empty else pd.DataFrame(df), path)


STAGE_DIRS = {
    "capture_tokens": "capture",
    "simulate": "simulate",
    "emulate": "emulate",
    "expb": "expb",
    "engine": "engine",
    "generate": "generate",
    "calibration": "engine",
}


def model_of(path: str, kind: str) -> str:
    """The `{model}` of an artefact path `.../{model}/{stage}/...` ("" when the path has none)."""
    parts = Path(path).parts
    if (
        kind == "model_summary"
    ):  # results/{model}/model/train_summary.json or {model}/checkpoint.json
        return (
            parts[-3]
            if len(parts) >= 3 and parts[-2] == "model"
            else (parts[-2] if len(parts) >= 2 else "")
        )
    stage = STAGE_DIRS.get(kind)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == stage:
            return parts[i - 1]
    return ""


def split_by_model(files: dict[str, list[str]]) -> dict[str, dict[str, list[str]]]:
    """model -> inputs of that model (engine_bench is shared and left out); at least one group."""
    groups: dict[str, dict[str, list[str]]] = {}
    for kind, paths in files.items():
        if kind == "engine_bench":
            continue
        for path in paths:
            model = model_of(path, kind)
            group = groups.setdefault(model, {k: [] for k in DATA_KINDS + EXTRA_KINDS})
            group[kind].append(path)
    return dict(sorted(groups.items())) or {"": {k: [] for k in DATA_KINDS + EXTRA_KINDS}}


def _merge_parts(per_model: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    if len(per_model) == 1:
        return next(iter(per_model.values()))
    out: dict[str, dict[str, Any]] = {}
    names = sorted({n for parts in per_model.values() for n in parts})
    for name in names:
        entries = {m: parts.get(name, _missing("not run")) for m, parts in per_model.items()}
        statuses = {e["status"] for e in entries.values()}
        status = statuses.pop() if len(statuses) == 1 else "partial"
        why = [f"{m}: {e['reason']}" for m, e in entries.items() if e.get("reason")]
        notes = [f"{m}: {e['note']}" for m, e in entries.items() if e.get("note")]
        out[name] = {"status": status}
        if why:
            out[name]["reason"] = "; ".join(why)
        if notes:
            out[name]["note"] = "; ".join(notes)
    return out


def _engine_bench(paths: list[str]) -> tuple[pd.DataFrame, dict[str, Any], list[dict]]:
    if not paths:
        return pd.DataFrame(), _missing("no engine benchmark artefacts"), []
    con = duckdb.connect()
    try:
        df = con.execute(
            f"SELECT * FROM read_parquet({_sql_list(paths)}, union_by_name=true) ORDER BY ALL"
        ).df()
    finally:
        con.close()
    prov = []
    for path in paths:
        info = file_info(path, "engine_bench")
        meta = {k: info.meta[k] for k in PROVENANCE_KEYS if k in info.meta}
        prov.append({"kind": "engine_bench", "path": path, "rows": info.rows, "metadata": meta})
    return df, {"status": "ok"}, prov


def run_analysis(
    inputs: Mapping[str, Sequence[str | os.PathLike]],
    params: Mapping[str, Any],
    out_dir: str | os.PathLike,
) -> dict[str, Any]:
    """Compute every statistic of the study from the artefacts; write them into `out_dir`.

    `inputs`: kind -> paths, kinds from `DATA_KINDS` (+ `model_summary`, `calibration` JSON for
    the report); any may be empty (that part is marked missing). Artefacts of several models
    (`results/{model}/...`) are analysed per model; every table gets a `model` column and every
    scalar result a `model` key. `params`: see `AnalysisParams.from_mapping` (`policies`,
    `expb` {primary, alpha, min_heavy_fraction, max_gap}, `n_boot`, `seed`, `ci_level`,
    `baseline`, `host_baseline`, `admission_bins`). Returns the content of `analysis.json`.
    """
    files = check_inputs(inputs)
    p = AnalysisParams.from_mapping(params)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} exists and is not a directory")
    groups = split_by_model(files)
    analyses = {}
    for model, group in tqdm(groups.items(), desc="analysis", unit="model", disable=None):
        analyses[model] = _Analysis(group, p)
        analyses[model].run()
    bench, bench_part, bench_prov = _engine_bench(files["engine_bench"])
    tables: dict[str, pd.DataFrame] = {"engine_bench": bench}
    for name in OUTPUT_FILES:
        if name == "engine_bench":
            continue
        frames = [
            a.tables[name].assign(model=m)[["model", *a.tables[name].columns]]
            for m, a in analyses.items()
            if not a.tables.get(name, pd.DataFrame()).empty
        ]
        tables[name] = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_FILES:
        _write(tables[name], out / f"{name}.parquet")

    def tagged(key: str) -> list[dict[str, Any]]:
        res = []
        for m, a in analyses.items():
            value = a.results.get(key)
            if isinstance(value, list):
                res.extend({"model": m, **v} for v in value)
            elif value is not None:
                res.append({"model": m, **value})
        return res

    parts = _merge_parts({m: a.parts for m, a in analyses.items()})
    parts["engine_bench"] = bench_part
    doc = _none_if_nan(
        {
            "params": asdict(p),
            "models": list(analyses),
            "parts": parts,
            "dppl_base": {m: a.results.get("dppl_base", {}) for m, a in analyses.items()},
            "mass_hypothesis": tagged("mass_hypothesis"),
            "expb": tagged("expb"),
            "admission": tagged("admission"),
            "sim_vs_engine": tagged("sim_vs_engine"),
            "provenance": [{**r, "model": m} for m, a in analyses.items() for r in a.provenance()]
            + bench_prov,
            "files": {name: f"{name}.parquet" for name in OUTPUT_FILES},
        }
    )
    write_json(doc, out / "analysis.json")
    return json.loads(json.dumps(doc))
