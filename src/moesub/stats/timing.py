"""Timing: simulate tables, priced runs, engine tables, the speed/quality frontier, simulator vs
engine.

Engine time per token is the median of per-token `wall_s` (CI: distribution-free order
statistics); speedups are ratios of medians on the same device and fraction. The simulator's
time per token is the pricing's (`moesub.price`, per hardware profile); `est_time_per_token_s`
of the simulate totals is its `this_machine` time (the engine's calibration). The pricing is
compared with the engine's mean (an expected time per token) on the engine's own tokens; the
simulator's tokens against those is the token-set effect, reported beside.

Entry points: `simulate`, `priced`, `engine`, `speed_quality`, `sim_vs_engine` (per model) and
`engine_bench(paths, p)` (the shared benchmark, not per model, with its errors' intervals and
its calibration runs' errors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import duckdb
import numpy as np
import pandas as pd

from moesub.hardware import PRICE_HELD_TO, THIS_MACHINE
from moesub.io import read_metadata
from moesub.metrics import speedup
from moesub.run_speed import JACKKNIFE_ERRORS, JACKKNIFE_MIN_ROUNDS, ROUND_SUMS, STREAM_SUMS
from moesub.stats.intervals import (
    Interval,
    correlation,
    median_ci,
    rng_for,
    stream_bootstrap,
    t_interval,
)
from moesub.stats.load import FileInfo, file_info, missing, provenance_entry, sql_list
from moesub.stats.params import AnalysisParams
from moesub.stats.tokens import register_files


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


class Simulate(NamedTuple):
    """`total`: the simulator's all-layer row per (policy, fraction) (every simulate column);
    `layers`: per (policy, fraction, layer) hit and substitution rates, mass per token-layer
    (`layer_hit_rates.parquet`); `status`."""

    total: pd.DataFrame
    layers: pd.DataFrame
    status: dict[str, Any]


class Engine(NamedTuple):
    """`table`: per (policy, fraction, device) the engine's time per token with its interval and
    speedups; `status`."""

    table: pd.DataFrame
    status: dict[str, Any]


class SpeedQuality(NamedTuple):
    """`table`: per (policy, fraction, time source) time per token, Δppl % and the frontier."""

    table: pd.DataFrame
    status: dict[str, Any]


class SimVsEngine(NamedTuple):
    """`table`: per (policy, fraction, device) the simulator's estimate vs the engine's mean;
    `result`: the error summary (`analysis.json["sim_vs_engine"]`, None when missing)."""

    table: pd.DataFrame
    result: dict[str, Any] | None
    status: dict[str, Any]


def simulate(db: duckdb.DuckDBPyConnection, runs: list[FileInfo]) -> Simulate:
    """The simulate runs' tables, read through `db`."""
    if not runs:
        return Simulate(pd.DataFrame(), pd.DataFrame(), missing("no simulate artefacts"))
    files = register_files(db, "simulate", runs)
    sim = db.execute(
        f"""
        SELECT f.name AS policy, f.fraction, t.* EXCLUDE (policy, fraction)
        FROM read_parquet({sql_list([i.path for i in runs])}, filename=true,
                          union_by_name=true) t
        JOIN {files} f USING (filename) ORDER BY policy, fraction, layer
        """
    ).df()
    total = sim[sim["layer"] == -1].reset_index(drop=True)
    # simulate's per-layer mass_mean is already a mean over that layer's token-layers
    layers = (
        sim[sim["layer"] >= 0][
            ["policy", "fraction", "layer", "tokens", "hit_rate", "sub_rate", "mass_mean"]
        ]
        .rename(columns={"mass_mean": "mass_per_token_layer"})
        .reset_index(drop=True)
    )
    return Simulate(total, layers, {"status": "ok"})


def priced(paths: list[str], sim_total: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The priced runs of every hardware profile (`priced.parquet`), and the simulate totals
    with `est_time_per_token_s`: the simulator's tokens priced on `this_machine` (NaN where
    that profile was not priced)."""
    if not paths:
        return pd.DataFrame(), sim_total.assign(est_time_per_token_s=np.nan)
    con = duckdb.connect()
    try:
        df = con.execute(
            f"SELECT * FROM read_parquet({sql_list(paths)}, union_by_name=true) "
            "ORDER BY hardware, source, device, policy, fraction"
        ).df()
    finally:
        con.close()
    if sim_total.empty:
        return df, sim_total
    here = df[(df["hardware"] == THIS_MACHINE) & (df["source"] == "simulator")]
    here = here[["policy", "fraction", "time_per_token_s"]]
    total = sim_total.merge(
        here.rename(columns={"time_per_token_s": "est_time_per_token_s"}),
        on=["policy", "fraction"],
        how="left",
    )
    return df, total


def engine(db: duckdb.DuckDBPyConnection, runs: list[FileInfo], p: AnalysisParams) -> Engine:
    """Per engine run (policy, fraction, device): the median time per token with its interval,
    the speedups vs the baselines on the same device and fraction; read through `db`."""
    if not runs:
        return Engine(pd.DataFrame(), missing("no engine artefacts"))
    files = register_files(db, "engine", runs)
    tok = db.execute(
        f"""
        SELECT f.name, f.fraction, f.device, t.wall_s, t.fetch_wait_s, t.nll
        FROM read_parquet({sql_list([i.path for i in runs])}, filename=true,
                          union_by_name=true) t
        JOIN {files} f USING (filename) ORDER BY f.name, f.fraction, f.device
        """
    ).df()
    tiers = {(i.name, i.fraction, i.device): i.meta.get("tier") for i in runs}
    rows = []
    for (name, frac, dev), g in tok.groupby(["name", "fraction", "device"], sort=True):
        wall = g["wall_s"].to_numpy(float)
        lo, hi = median_ci(wall, p.ci_level)
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
        (p.baseline, "speedup_vs_fetch_every_miss"),
        (p.host_baseline, "speedup_vs_host_compute"),
    ):
        base = eng[eng["policy"] == ref].set_index(["fraction", "device"])["time_per_token_s"]
        keys = list(zip(eng["fraction"], eng["device"], strict=True))
        eng[col] = speedup([base.get(k, np.nan) for k in keys], eng["time_per_token_s"])
    return Engine(eng, {"status": "ok"})


def speed_quality(
    quality: pd.DataFrame, eng: pd.DataFrame, sim: pd.DataFrame, p: AnalysisParams
) -> SpeedQuality:
    """Time per token (engine table `eng`, simulate totals `sim`) beside Δppl (`quality`,
    `Quality.table`), with the Pareto front per (fraction, device)."""
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
            (p.baseline, "speedup_vs_fetch_every_miss"),
            (p.host_baseline, "speedup_vs_host_compute"),
        ):
            base = s[s["policy"] == ref].set_index("fraction")["time_per_token_s"]
            s[col] = speedup(s["fraction"].map(base), s["time_per_token_s"])
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
    if not frames or quality.empty:
        why = "needs emulate (Δppl) and engine or simulate (time per token)"
        return SpeedQuality(pd.DataFrame(), missing(why))
    sq = pd.concat(frames, ignore_index=True).merge(
        quality[["policy", "fraction", "dppl_pct", "dppl_ci_lo", "dppl_ci_hi", "dppl_bias"]],
        on=["policy", "fraction"],
        how="inner",
    )
    sq["frontier"] = False
    for _, idx in sq.groupby(["fraction", "device"]).groups.items():
        sq.loc[idx, "frontier"] = pareto_front(
            sq.loc[idx, "time_per_token_s"], sq.loc[idx, "dppl_pct"]
        )
    sq = sq.sort_values(["source", "device", "fraction", "time_per_token_s"], ignore_index=True)
    return SpeedQuality(sq, {"status": "ok"})


def calibration_run_errors(paths: list[str]) -> dict[str, float] | None:
    """this_machine's calibration mechanisms priced at the profile fitted to them, from its
    priced table's metadata (`moesub.price.run_price`); None where none was kept."""
    for path in paths:
        meta = read_metadata(path)
        if meta.get("hardware") == THIS_MACHINE:
            return meta.get("calibration_run_errors")
    return None


def sim_vs_engine(
    eng: pd.DataFrame,
    sim: pd.DataFrame,
    prices: pd.DataFrame,
    p: AnalysisParams,
    calibration_errors: dict[str, float] | None = None,
) -> SimVsEngine:
    """Per engine run (`eng`, `Engine.table`) priced on this machine (`prices`: the engine rows
    of `priced`): `est_time_per_token_s` (the engine's own per-token-layer counts priced) against
    the engine's mean, `rel_error`; beside it the simulator's tokens priced (`sim` totals'
    `est_time_per_token_s`: `sim_time_per_token_s`) and `token_set_effect` = simulator / engine
    tokens - 1 (same profile, other tokens and the simulator's admission timing); the run's
    CPU share, the cores other processes used beside it (`other_cores`) and `contended` flag;
    `rel_error_at_run_disk`: the engine's tokens priced at the disk's speed while the run read
    (`moesub.price.costs_at_run_disk`; NaN where the tier reads no file);
    `rel_error_at_run_speed`: also with their compute at the machine's speed while it ran
    (`run_speed`, probed on the run's own tokens that only hit; `moesub.price`);
    `rel_error_ci_lo` / `_hi` / `_crosses`: `rel_error`'s interval over the run's streams
    resampled (`with_error_intervals`; where the price stage recorded them); `rel_error_jk_lo`
    / `_hi` / `_crosses` and `calibration_share`: its jackknife over the engine stage's rounds,
    the calibration refitted without each (`with_jackknife_intervals`). The result also
    carries the calibration's own runs' errors (`calibration_errors`:
    `calibration_run_errors`), where given."""
    engine_rows = prices[prices["source"] == "engine"] if not prices.empty else prices
    if eng.empty or engine_rows.empty:
        return SimVsEngine(
            pd.DataFrame(), None, missing("needs engine runs priced on this_machine")
        )
    j = eng[["policy", "fraction", "device", "n_tokens", "time_mean_s", "time_per_token_s"]]
    for col in ("time_per_token_at_run_disk_s", "other_cores", "run_speed",
                "time_per_token_at_run_speed_s", *STREAM_SUMS, *JACKKNIFE_ERRORS):  # fmt: skip
        # a priced table from before the column: NaN
        engine_rows = engine_rows.assign(**{col: engine_rows.get(col, np.nan)})
    est = engine_rows[["policy", "fraction", "device", "time_per_token_s",
                       "time_per_token_at_run_disk_s", "run_speed",
                       "time_per_token_at_run_speed_s", "cpu_share", "other_cores",
                       "contended", *STREAM_SUMS, *JACKKNIFE_ERRORS]]  # fmt: skip
    j = j.merge(
        est.rename(columns={"time_per_token_s": "est_time_per_token_s",
                            "time_per_token_at_run_disk_s": "est_at_run_disk_s",
                            "time_per_token_at_run_speed_s": "est_at_run_speed_s"}),
        on=["policy", "fraction", "device"],
    )  # fmt: skip
    if j.empty:
        return SimVsEngine(j, None, missing("no engine run was priced on this_machine"))
    j["rel_error"] = j["est_time_per_token_s"] / j["time_mean_s"] - 1.0
    j = with_error_intervals(j, STREAM_SUMS, "rel_error", p, source="sim_vs_engine")
    j = with_jackknife_intervals(j, p, "rel_error")
    for at in ("disk", "speed"):
        j[f"rel_error_at_run_{at}"] = j[f"est_at_run_{at}_s"].astype(float) / j["time_mean_s"] - 1
    if not sim.empty:
        s = sim[["policy", "fraction", "est_time_per_token_s"]]
        j = j.merge(
            s.rename(columns={"est_time_per_token_s": "sim_time_per_token_s"}),
            on=["policy", "fraction"],
            how="left",
        )
    else:
        j["sim_time_per_token_s"] = np.nan
    j["token_set_effect"] = j["sim_time_per_token_s"] / j["est_time_per_token_s"] - 1.0
    err = j["rel_error"].abs().to_numpy()
    effect = j["token_set_effect"].abs().dropna().to_numpy()
    at_disk = j["rel_error_at_run_disk"].abs().dropna().to_numpy()
    at_speed = j["rel_error_at_run_speed"].abs().dropna().to_numpy()
    result = {
        "n": len(j),
        "median_abs_rel_error": float(np.median(err)),
        "max_abs_rel_error": float(err.max()),
        "n_within": int((err <= PRICE_HELD_TO).sum()),  # of n, within what the pricing is held to
        # priced at the disk's speed while each run read (the disk tier's runs)
        "n_at_run_disk": int(at_disk.size),
        "n_within_at_run_disk": int((at_disk <= PRICE_HELD_TO).sum()),
        "median_abs_rel_error_at_run_disk": float(np.median(at_disk)) if at_disk.size else None,
        "max_abs_rel_error_at_run_disk": float(at_disk.max()) if at_disk.size else None,
        # and with each run's compute at the machine's speed while it ran
        "n_at_run_speed": int(at_speed.size),
        "n_within_at_run_speed": int((at_speed <= PRICE_HELD_TO).sum()),
        "median_abs_rel_error_at_run_speed": float(np.median(at_speed)) if at_speed.size else None,
        "max_abs_rel_error_at_run_speed": float(at_speed.max()) if at_speed.size else None,
        "r": correlation(j["est_time_per_token_s"], j["time_mean_s"], parametric=False)["r"],
        "n_contended": int(j["contended"].fillna(False).astype(bool).sum()),
        "median_abs_token_set_effect": float(np.median(effect)) if effect.size else None,
        # over each run's streams resampled: the runs whose interval reaches past the bound
        # (within, beyond it; outside, inside it), of those with one
        **reaching(j, "rel_error", PRICE_HELD_TO),
        # and the jackknife over the engine stage's rounds, the calibration refitted
        **reaching(j, "rel_error", PRICE_HELD_TO, "jk"),
        "median_calibration_share": median_or_none(j.get("calibration_share")),
        "calibration_run_errors": calibration_errors,
    }
    return SimVsEngine(j, result, {"status": "ok"})


def reaching(table: pd.DataFrame, key: str, bound: float, kind: str = "ci") -> dict[str, int]:
    """Of the rows with an interval of `key` (`kind` "ci": `with_error_intervals`; "jk":
    `with_jackknife_intervals`): how many, the rows within `bound` whose interval reaches
    beyond it, the rows outside whose interval reaches inside it (0 each without the
    interval's columns)."""
    crosses = table.get(f"{key}_{kind}_crosses", pd.Series(pd.NA, index=table.index))
    within = table[key].abs() <= bound
    return {
        f"n_with_{kind}": int(crosses.notna().sum()),
        f"n_within_{kind}_beyond": int((crosses.fillna(False).astype(bool) & within).sum()),
        f"n_outside_{kind}_inside": int((crosses.fillna(False).astype(bool) & ~within).sum()),
    }


def median_or_none(values: pd.Series | None) -> float | None:
    """The median of a column's finite values; None where it has none (or is absent)."""
    if values is None:
        return None
    x = pd.to_numeric(values, errors="coerce").astype(float).to_numpy()
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else None


class EngineBench(NamedTuple):
    """`table`: the engine benchmark's rows as measured; `status` (with, per device, each
    calibration run's error at the profile fitted to them: `calibration_run_errors`);
    `provenance`: its files."""

    table: pd.DataFrame
    status: dict[str, Any]
    provenance: list[dict[str, Any]]


def error_interval(
    time_s: np.ndarray,
    priced_s: np.ndarray,
    p: AnalysisParams,
    key: str,
    *,
    source: str,
) -> Interval | None:
    """The pricing's error over a run's parts (`priced_s`, `time_s` (R,): each part's price and
    time in all; a bench policy's rounds, an engine run's streams), `sum(priced) / sum(time) -
    1`, with its interval over the parts resampled (`p.n_boot`, BCa at `p.ci_level`): a part
    is a stretch of the machine, so the interval is the machine's noise between the run's
    parts, at the calibration as fitted (the calibration runs' own noise is not in it: the
    bench's jackknife, `with_jackknife_intervals`, puts it in). No interval under 3 parts. Its
    resamples are drawn from the stream of `source` (the bench's, the engine stage's) and
    `key`."""
    if len(time_s) < 3:
        return None

    def error(w: np.ndarray) -> np.ndarray:  # (B, R) the parts' weights -> (B,)
        return (w @ priced_s) / (w @ time_s) - 1

    rng = rng_for(p.seed, source, key)
    return stream_bootstrap(error, len(time_s), p.n_boot, rng, p.ci_level)[0]


def with_error_intervals(
    table: pd.DataFrame,
    sums: tuple[str, str],
    key: str,
    p: AnalysisParams,
    *,
    source: str,
    bound: float = PRICE_HELD_TO,
) -> pd.DataFrame:
    """`table` with the interval of each row's error `key` over its parts (`sums`: the columns
    of its parts' times and prices, lists, `moesub.run_speed.ROUND_SUMS` / `STREAM_SUMS`;
    `error_interval`) in `{key}_ci_lo`, `_hi`, and `{key}_ci_crosses`: whether it reaches across
    `bound` from the error's side (a row within whose interval reaches beyond it, a row
    outside whose interval reaches inside it); the sums dropped; resamples from `source`'s
    stream. NA where a row has no parts or too few; a table without the sums' columns (an older
    artefact) comes back without these."""
    if not all(c in table.columns for c in sums):
        return table.drop(columns=[c for c in sums if c in table.columns])
    labels = [c for c in ("policy", "fraction", "device") if c in table.columns]
    lo, hi = np.full(len(table), np.nan), np.full(len(table), np.nan)
    for i, row in enumerate(table.itertuples()):
        time_s, priced_s = (getattr(row, c) for c in sums)
        if isinstance(time_s, (list, np.ndarray)) and isinstance(priced_s, (list, np.ndarray)):
            label = "/".join(str(getattr(row, c)) for c in labels)
            iv = error_interval(
                np.asarray(time_s, float), np.asarray(priced_s, float), p, label, source=source
            )
            if iv is not None and iv.ci_lo is not None and iv.ci_hi is not None:
                lo[i], hi[i] = iv.ci_lo, iv.ci_hi
    return table.drop(columns=list(sums)).assign(
        **interval_columns(table[key], lo, hi, f"{key}_ci", bound)
    )


def interval_columns(
    errors: pd.Series, lo: np.ndarray, hi: np.ndarray, prefix: str, bound: float
) -> dict[str, Any]:
    """Errors' interval bounds as columns `{prefix}_lo`, `_hi` (NaN -> NA) and `_crosses`:
    whether each reaches across `bound` from its error's side (within and reaching beyond it,
    outside and reaching inside it); NA where a row has no interval."""
    within = (errors.abs() <= bound).to_numpy()
    crosses = np.where(within, (lo < -bound) | (hi > bound), (lo <= bound) & (hi >= -bound))
    return {
        f"{prefix}_lo": pd.array(lo, dtype="Float64"),
        f"{prefix}_hi": pd.array(hi, dtype="Float64"),
        f"{prefix}_crosses": pd.Series(crosses, index=errors.index, dtype="boolean").mask(
            np.isnan(lo)
        ),
    }


def with_jackknife_intervals(
    table: pd.DataFrame, p: AnalysisParams, key: str = "sim_rel_error",
    bound: float = PRICE_HELD_TO,
) -> pd.DataFrame:  # fmt: skip
    """A table with its error `key`'s interval from a jackknife over the rounds, each round
    left out with the calibration refitted without it (`JACKKNIFE_ERRORS`, lists: the rounds
    and the calibration's noise together; `t_interval` at `p.ci_level`; the bench's rounds,
    the engine stage's): `{key}_jk_lo`, `_hi`, `_crosses` (`interval_columns`), and
    `calibration_share`: the calibration's refits' part of that jackknife variance (the
    variance of the errors with the calibration alone refitted, over the joint one's; near 1,
    the calibration's noise dominates the error's); the lists dropped. NA under 3 rounds; a
    table without the lists comes back as is."""
    joint_key, calibration_key = JACKKNIFE_ERRORS
    if joint_key not in table.columns:
        return table
    n = len(table)
    lo, hi, share = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    rows = zip(table[key], table[joint_key], table[calibration_key], strict=True)
    for i, (error, joint, calibration) in enumerate(rows):
        if not isinstance(joint, (list, np.ndarray)) or len(joint) < JACKKNIFE_MIN_ROUNDS:
            continue
        a, b, se = t_interval(float(error), np.asarray(joint, float), p.ci_level)
        if se is None:
            continue
        lo[i], hi[i] = a, b
        _, _, se_calibration = t_interval(float(error), np.asarray(calibration, float), p.ci_level)
        if se > 0 and se_calibration is not None:
            share[i] = (se_calibration / se) ** 2
    return table.drop(columns=list(JACKKNIFE_ERRORS)).assign(
        **interval_columns(table[key], lo, hi, f"{key}_jk", bound),
        calibration_share=pd.array(share, dtype="Float64"),
    )


def engine_bench(paths: list[str], p: AnalysisParams) -> EngineBench:
    """The shared engine benchmark (every model's rows in its own files), read as is, with
    `sim_rel_error`'s interval over each policy's rounds (`with_error_intervals`) in place of
    the rounds' sums, and its jackknife interval with the calibration refitted
    (`with_jackknife_intervals`) in place of the left-out errors."""
    if not paths:
        return EngineBench(pd.DataFrame(), missing("no engine benchmark artefacts"), [])
    con = duckdb.connect()
    try:
        df = con.execute(
            f"SELECT * FROM read_parquet({sql_list(paths)}, union_by_name=true) ORDER BY ALL"
        ).df()
    finally:
        con.close()
    df = with_error_intervals(df, ROUND_SUMS, "sim_rel_error", p, source="engine_bench")
    df = with_jackknife_intervals(df, p)
    prov = [provenance_entry(file_info(path, "engine_bench")) for path in paths]
    metas = [read_metadata(path) for path in paths]
    errors = {  # a bench from before they were kept has none
        m["device"]: m["calibration_run_errors"] for m in metas if "calibration_run_errors" in m
    }
    return EngineBench(df, {"status": "ok", "calibration_run_errors": errors}, prov)
