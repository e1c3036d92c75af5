"""The pricing's error against the engine, with its intervals, and the shared engine benchmark.

A run's error (its price over its time, less 1) gets two intervals: over its parts resampled
(`error_interval`, `with_error_intervals`: a bench policy's rounds, an engine run's streams;
the calibration held as fitted) and a jackknife over the rounds, each left out with the
calibration refitted without it (`with_jackknife_intervals`: its noise in too). `reaching` counts
the rows an interval takes across the bound the pricing is held to. `engine_bench(paths, p)`
reads the shared benchmark (not per model) with both; `moesub.stats.timing.sim_vs_engine` gives
the engine stage's runs the same.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import duckdb
import numpy as np
import pandas as pd

from moesub.hardware import PRICE_HELD_TO
from moesub.io import read_metadata
from moesub.run_speed import JACKKNIFE_ERRORS, JACKKNIFE_MIN_ROUNDS, ROUND_SUMS
from moesub.stats.intervals import Interval, rng_for, stream_bootstrap, t_interval
from moesub.stats.load import file_info, missing, provenance_entry, sql_list
from moesub.stats.params import AnalysisParams


def reaching(table: pd.DataFrame, key: str, bound: float, kind: str = "ci") -> dict[str, int]:
    """Of the rows with an interval of `key` (`kind` "ci": `with_error_intervals`; "jk":
    `with_jackknife_intervals`): how many, the rows within `bound` whose interval reaches
    beyond it, the rows outside whose interval reaches inside it."""
    crosses = table[f"{key}_{kind}_crosses"].fillna(False).astype(bool)
    within = table[key].abs() <= bound
    return {
        f"n_with_{kind}": int(table[f"{key}_{kind}_crosses"].notna().sum()),
        f"n_within_{kind}_beyond": int((crosses & within).sum()),
        f"n_outside_{kind}_inside": int((crosses & ~within).sum()),
    }


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
