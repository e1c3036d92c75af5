"""Timing: simulate tables, priced runs, engine tables, the speed/quality frontier, simulator vs
engine.

Engine time per token is the median of per-token `wall_s` (CI: distribution-free order
statistics); speedups are ratios of medians on the same device and fraction. The simulator's
time per token is the pricing's (`moesub.price`, per hardware profile); `est_time_per_token_s`
of the simulate totals is its `this_machine` time (the engine's calibration). The pricing is
compared with the engine's mean (an expected time per token) on the engine's own tokens; the
simulator's tokens against those is the token-set effect, reported beside.

Entry points: `simulate`, `priced`, `engine`, `speed_quality`, `sim_vs_engine` (per model; the
pricing error's intervals and the shared engine benchmark: `moesub.stats.pricing_error`).
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
from moesub.run_speed import JACKKNIFE_ERRORS, STREAM_SUMS
from moesub.stats.intervals import (
    correlation,
    median_ci,
)
from moesub.stats.load import FileInfo, missing, sql_list
from moesub.stats.params import AnalysisParams
from moesub.stats.pricing_error import reaching, with_error_intervals, with_jackknife_intervals
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
    shares = j["calibration_share"].dropna().to_numpy(dtype=float)
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
        "median_calibration_share": float(np.median(shares)) if shares.size else None,
        "calibration_run_errors": calibration_errors,
    }
    return SimVsEngine(j, result, {"status": "ok"})
