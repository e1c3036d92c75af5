"""Experiment B, factorial design: the effect of a substituted expert's gate weight at a fixed
rank, and of its rank at a fixed weight.

Inputs: the four cells' per-token artefacts (`.../expb/factorial/{cell}.parquet`, planned by
`moesub.expb.factorial`), the captured exact NLL and the calibration feasibility table.

Unit: ΔNLL per substituted token-layer. Per cell c and stream s,
`D_c(s) = sum over the stream's tokens of (nll_c - nll_exact) / n(s)`, n(s) the token-layers the
plan substitutes in s: the same in every cell (checked), so a difference of D between cells is a
difference of the stream's summed ΔNLL on one scale. (A planned expert that the perturbed live
router no longer selects at rank >= 2 is not substituted: counted as dropped.)

Tests, each on the per-stream differences d(s) (`TESTS`), each a `StatTest`
(`moesub.stats.multiplicity`) of kind:

- `expb_factorial_main` (the pre-registered family, Holm): `weight` = (D_low_heavy - D_low_light
  + D_high_heavy - D_high_light) / 2, the main effect of heavy vs light at a fixed rank bucket;
  `rank` = (D_high_light - D_low_light + D_high_heavy - D_low_heavy) / 2, the main effect of the
  high vs the low rank bucket at a fixed weight band;
- `expb_factorial_bucket` (exploratory, Benjamini-Hochberg): the four simple effects
  `weight_at_low`, `weight_at_high`, `rank_at_light`, `rank_at_heavy`
  (`moesub.expb.factorial.CONTRASTS`: other - reference).

Each reports the mean of d over streams, the raw two-sided p-value of a one-sample t-test of
mean d = 0 over the streams and the interval that test inverts (mean -/+ t_{S-1} SD / sqrt(S):
the stream bootstrap's t interval, whose jackknife SE of a mean is exactly SD / sqrt(S)); the
stream-bootstrap interval (BCa, basic where BCa is undefined) beside it as a sensitivity figure
(with a few streams it has few distinct resamples and is too narrow); and the minimum detectable
effect (two-sided, at alpha and `power`: a normal-approximation sensitivity figure). The
family-adjusted p and the direction in words are `tests.parquet`'s (`name` joins the tables).

Hypotheses (the mass hypothesis: a substitution costs in proportion to the gate weight it
removes, whatever its rank):

- weight: predicted > 0 (`expected` +1): "supports" when the adjusted p < alpha and the
  estimate > 0, "evidence against the hypothesis" when < 0;
- rank: predicted 0 (`expected` 0): "evidence against the hypothesis" when the adjusted p <
  alpha, either way (the rank matters at the same weight);
- else "no detectable effect" with the MDE beside it;
- a rank contrast is invalid (no p-value, its reason) when its two cells' realized mean weights
  differ by more than `max_weight_gap` (relative to the smaller; the pooled `rank` when either
  does), and the part is missing when the cells' runs do not share one plan (streams, counts
  per stream).

Entry point: `expb_factorial(tokens, runs, feasibility, p) -> ExpBFactorial`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import polars as pl
from scipy import stats as sps

from moesub.config import FACTORIAL_CELLS as CELLS
from moesub.io import read_metadata
from moesub.stats.intervals import level_label, rng_for, stream_bootstrap
from moesub.stats.load import FileInfo, missing
from moesub.stats.multiplicity import FAMILY, StatTest
from moesub.stats.params import AnalysisParams
from moesub.stats.power import paired_mde
from moesub.stats.tokens import Tokens

UNIT = "ΔNLL per substituted token-layer"
MAIN, BUCKET = "expb_factorial_main", "expb_factorial_bucket"  # `StatTest` kinds
PREFIX = "expb.factorial."  # a test's name: the prefix and its `TESTS` name
# (test, kind, expected sign (0: no effect), {cell: coefficient}): d(s) = sum coef * D_cell(s)
TESTS = (
    ("weight", MAIN, 1,
     {"low_heavy": 0.5, "low_light": -0.5, "high_heavy": 0.5, "high_light": -0.5}),
    ("rank", MAIN, 0,
     {"high_light": 0.5, "low_light": -0.5, "high_heavy": 0.5, "low_heavy": -0.5}),
    ("weight_at_low", BUCKET, 1, {"low_heavy": 1.0, "low_light": -1.0}),
    ("weight_at_high", BUCKET, 1, {"high_heavy": 1.0, "high_light": -1.0}),
    ("rank_at_light", BUCKET, 0, {"high_light": 1.0, "low_light": -1.0}),
    ("rank_at_heavy", BUCKET, 0, {"high_heavy": 1.0, "low_heavy": -1.0}),
)  # fmt: skip
PREDICTED = {1: "> 0", 0: "= 0"}
HYPOTHESES = {
    "weight": "at a fixed rank, a heavier substitution costs more (the mass hypothesis)",
    "rank": "at a fixed gate weight, the rank of the substituted expert does not matter",
}
LABELS = {
    "weight": "heavy − light at a fixed rank (mean over the rank buckets)",
    "rank": "high − low rank at a fixed weight (mean over the weight bands)",
    "weight_at_low": "heavy − light, low rank bucket",
    "weight_at_high": "heavy − light, high rank bucket",
    "rank_at_light": "high − low rank, light band",
    "rank_at_heavy": "high − low rank, heavy band",
}


# ---------------------------------------------------------------------------------- statistics
def contrast_matrix() -> np.ndarray:
    """(4, 6) coefficients: per-stream differences (S, 6) = D (S, 4 cells) @ this."""
    out = np.zeros((len(CELLS), len(TESTS)))
    for j, (_, _, _, coef) in enumerate(TESTS):
        for cell, c in coef.items():
            out[CELLS.index(cell), j] = c
    return out


def factorial_tests(
    d_cells: np.ndarray, alpha: float, power: float, level: float, n_boot: int, seed: int
) -> list[dict[str, Any]]:
    """One entry per test of `TESTS` from the per-stream cell values `d_cells` (S, 4 cells):
    estimate (mean over streams), its stream-bootstrap and t intervals, raw two-sided t-test p
    (it inverts the t interval), MDE."""
    diffs = d_cells @ contrast_matrix()  # (S, 6)
    n = diffs.shape[0]
    intervals = stream_bootstrap(
        lambda w: (w @ diffs) / w.sum(axis=1, keepdims=True),
        n,
        n_boot,
        rng_for(seed, "expb_factorial"),
        level,
    )
    out = []
    for j, (test, kind, expected, _) in enumerate(TESTS):
        d = diffs[:, j]
        sd = float(d.std(ddof=1)) if n > 1 else None
        p = float(sps.ttest_1samp(d, 0.0).pvalue) if n > 1 and sd else None
        mde = paired_mde(sd, n, alpha, power, "two-sided") if sd else None
        iv = intervals[j]
        out.append(
            {
                "name": PREFIX + test,
                "test": test,
                "kind": kind,
                "family": FAMILY[kind],
                "label": LABELS[test],
                "expected": expected,
                "predicted": PREDICTED[expected],
                "estimate": iv.estimate,
                **iv.columns("estimate_"),
                "p_value": p,
                "p_method": "two-sided one-sample t-test over streams",
                "n_streams": n,
                "sd": sd,
                "mde": mde,
                "mde_method": "normal approximation, two-sided",
                "unit": UNIT,
            }
        )
    return out


# ---------------------------------------------------------------------------------- loading
def cell_streams(tokens: Tokens, runs: list[FileInfo]) -> tuple[pl.DataFrame, dict]:
    """Per (cell, stream): planned and substituted token-layers, the summed ΔNLL, tokens, the
    realized weight and rank sums; and per cell its substituted token-layers as a set of
    (stream, pos, layer) keys (for the shared shares)."""
    cap = pl.from_pandas(tokens.db.execute("SELECT stream, pos, nll AS nll_exact FROM cap").df())
    cap = cap.with_columns(pl.col("stream").cast(pl.Int32), pl.col("pos").cast(pl.Int32))
    frames, substituted = [], {}
    for info in runs:
        df = pl.read_parquet(info.path).join(cap, on=["stream", "pos"], how="left")
        lm = np.stack(df["layer_mass"].to_list())  # (N, L) realized weight per token-layer
        at = np.argwhere(lm > 0)
        substituted[info.condition] = set(
            zip(df["stream"].to_numpy()[at[:, 0]], df["pos"].to_numpy()[at[:, 0]], at[:, 1],
                strict=True)
        )  # fmt: skip
        frames.append(
            df.with_columns(dnll=pl.col("nll") - pl.col("nll_exact"), weight=lm.sum(axis=1))
            .group_by("stream")
            .agg(
                planned=pl.col("n_planned").sum(),
                substituted=pl.col("n_sub").sum(),
                dnll_sum=pl.col("dnll").sum(),
                n_tokens=pl.col("dnll").count(),
                weight_sum=pl.col("weight").sum(),
                rank_sum=pl.col("rank_sum").sum(),
            )
            .with_columns(cell=pl.lit(info.condition))
        )
    per = pl.concat(frames).sort("cell", "stream")
    return per.with_columns(dnll_per_sub=pl.col("dnll_sum") / pl.col("planned")), substituted


def plan_problem(per: pl.DataFrame, metas: dict[str, dict]) -> str | None:
    """Why the cells' runs cannot be compared (not one plan), or None."""
    if set(metas) != set(CELLS):
        return f"cells run: {sorted(metas)}; all of {list(CELLS)} are needed"
    specs = {str((m.get("spec"), m.get("seed"))) for m in metas.values()}
    if len(specs) > 1:
        return "the cells' runs were planned with different specs or seeds"
    wide = per.pivot(on="cell", index="stream", values="planned")
    if wide.null_count().sum_horizontal().item() or any(
        (wide[c] != wide[CELLS[0]]).any() for c in CELLS
    ):
        return "the cells substitute different streams or counts per stream"
    if (wide[CELLS[0]] == 0).any():
        return "a stream has no planned substitution"
    return None


# ---------------------------------------------------------------------------------- the part
def stat_test(row: dict[str, Any], level: float) -> StatTest:
    """One row of the tests table as a `StatTest` (module doc): the t interval the t-test
    inverts as its interval (and as its t interval), the stream bootstrap's as the sensitivity
    line."""
    lo, hi = row.get("estimate_ci_lo"), row.get("estimate_ci_hi")
    boot = "none" if lo is None or hi is None else f"[{lo:+.3g}, {hi:+.3g}]"
    reason = None
    if not row["valid"]:
        reason = f"invalid ({row['invalid_reason']})"
    elif row["p_value"] is None:
        reason = f"no t-test ({row['n_streams']} streams; it needs 2 with some spread)"
    test = row["test"]
    return StatTest(
        kind=row["kind"],
        name=row["name"],
        hypothesis=HYPOTHESES[test.split("_at_")[0]],
        expected=row["expected"],
        estimand=f"{row['label']}, {UNIT}, mean over streams",
        estimate=row["estimate"],
        ci_lo=row.get("estimate_t_ci_lo"),
        ci_hi=row.get("estimate_t_ci_hi"),
        ci_method="t over streams (the interval the one-sample t-test inverts)",
        t_ci_lo=row.get("estimate_t_ci_lo"),
        t_ci_hi=row.get("estimate_t_ci_hi"),
        p_value=row["p_value"] if row["valid"] else None,
        p_method=row["p_method"],
        mde=row["mde"],
        n_units=row["n_streams"],
        sensitivity=(
            f"stream bootstrap {level_label(level)} ({row.get('estimate_ci_method')}): {boot}"
        ),
        reason=reason,
    )


class ExpBFactorial(NamedTuple):
    """`table`: one row per test (`TESTS`); `cells`: one row per cell; `streams`: one row per
    (cell, stream); `results`: `analysis.json["expb_factorial"]` (None when missing); `tests`:
    the table's rows as `StatTest`s."""

    table: pd.DataFrame
    cells: pd.DataFrame
    streams: pd.DataFrame
    results: dict[str, Any] | None
    tests: list[StatTest]
    status: dict[str, Any]


def expb_factorial(
    tokens: Tokens, runs: list[FileInfo], feasibility: list[str], p: AnalysisParams
) -> ExpBFactorial:
    """The factorial design's tests from its cells' runs, the captured exact NLL (`cap`) and
    the calibration feasibility table (`feasibility`: its path, maybe none)."""

    def not_run(why: str) -> ExpBFactorial:
        empty = pd.DataFrame()
        return ExpBFactorial(empty, empty, empty, None, [], missing(why))

    if p.expb is None or p.expb.factorial is None:
        return not_run("disabled (expb.designs.factorial.enabled: false)")
    if not runs:
        return not_run("no factorial Experiment B artefacts")
    if not tokens.captured:
        return not_run("the factorial Experiment B needs the captured exact NLL (capture)")
    metas = {info.condition: info.meta for info in runs}
    per, substituted = cell_streams(tokens, runs)
    problem = plan_problem(per, metas)
    if problem:
        return not_run(f"factorial: {problem}")
    wide = per.pivot(on="cell", index="stream", values="dnll_per_sub").sort("stream")
    d_cells = wide.select(CELLS).to_numpy()  # (S, 4)
    alpha = p.expb.alpha
    tests = factorial_tests(d_cells, alpha, p.power, p.ci_level, p.n_boot, p.seed)
    levels = stream_bootstrap(
        lambda w: (w @ d_cells) / w.sum(axis=1, keepdims=True),
        d_cells.shape[0], p.n_boot, rng_for(p.seed, "expb_factorial", "cells"), p.ci_level,
    )  # fmt: skip
    cells = []
    for c, iv in zip(CELLS, levels, strict=True):
        rows = per.filter(pl.col("cell") == c)
        n_sub = int(rows["substituted"].sum())
        ranks, band = c.split("_")
        spec = metas[c].get("spec") or {}
        cells.append(
            {
                "cell": c,
                "ranks": spec.get(f"{ranks}_ranks"),
                "band": spec.get(band),
                "planned": int(rows["planned"].sum()),
                "substituted": n_sub,
                "dropped": 1 - n_sub / int(rows["planned"].sum()),
                "mean_weight": float(rows["weight_sum"].sum() / n_sub) if n_sub else None,
                "mean_rank": float(rows["rank_sum"].sum() / n_sub) if n_sub else None,
                "dnll_per_sub": iv.estimate,
                **iv.columns("dnll_per_sub_"),
                "dnll_per_token": float(rows["dnll_sum"].sum() / rows["n_tokens"].sum()),
                "support": (metas[c].get("plan_support") or {}).get(c),
            }
        )
    by_cell = {r["cell"]: r for r in cells}
    add_balance(tests, by_cell, substituted, p.expb.factorial.max_weight_gap)
    meta = metas[CELLS[0]]
    results = {
        "unit": UNIT,
        "spec": meta.get("spec"),
        "seed": meta.get("seed"),
        "alpha": alpha,
        "ci_level": p.ci_level,
        "power": p.power,
        "max_weight_gap": p.expb.factorial.max_weight_gap,
        "plan": {k.removeprefix("plan_"): v for k, v in meta.items() if k.startswith("plan_")},
        "calibration": _feasibility(feasibility),
        "tests": tests,
        "cells": cells,
    }
    return ExpBFactorial(
        pd.DataFrame(tests),
        pd.DataFrame(cells),
        per.to_pandas(),
        results,
        [stat_test(t, p.ci_level) for t in tests],
        {"status": "ok"},
    )


def add_balance(
    tests: list[dict[str, Any]], cells: dict[str, dict], substituted: dict[str, set], gap: float
) -> None:
    """Adds to each test its cells' balance (realized mean weight and rank of the two sides,
    their relative weight gap, the share of the substituted token-layers the paired cells
    share) and its validity (`valid`, `invalid_reason`)."""
    why_rank = {}
    for t in tests:
        coef = dict(next(c for name, _, _, c in TESTS if name == t["test"]))
        plus = [c for c, v in coef.items() if v > 0]
        minus = [c for c, v in coef.items() if v < 0]
        t["weight_other"] = float(np.mean([cells[c]["mean_weight"] for c in plus]))
        t["weight_reference"] = float(np.mean([cells[c]["mean_weight"] for c in minus]))
        t["rank_other"] = float(np.mean([cells[c]["mean_rank"] for c in plus]))
        t["rank_reference"] = float(np.mean([cells[c]["mean_rank"] for c in minus]))
        pairs = list(zip(minus, plus, strict=True))
        both = sum(len(substituted[a] & substituted[b]) for a, b in pairs)
        count = sum(max(len(substituted[a]), len(substituted[b])) for a, b in pairs)
        t["shared"] = both / count if count else None
        w_a, w_b = t["weight_reference"], t["weight_other"]
        rel = abs(w_b - w_a) / min(w_a, w_b) if min(w_a, w_b) > 0 else math.inf
        t["weight_gap"], t["valid"], t["invalid_reason"] = rel, True, None
        # at a fixed band the two cells' weights should match
        if t["test"].startswith("rank_at") and rel > gap + 1e-12:
            why_rank[t["test"]] = (
                f"realized mean weights {w_a:.4g} vs {w_b:.4g} differ by {100 * rel:.1f}% "
                f"> {100 * gap:g}%"
            )
    for t in tests:
        why = why_rank.get(t["test"])
        if t["test"] == "rank" and why_rank:
            why = " and ".join(sorted(why_rank)) + " invalid"
        if why:
            t["valid"], t["invalid_reason"] = False, why


def _feasibility(paths: list[str]) -> dict[str, Any] | None:
    """The calibration plan's figures (the feasibility table's metadata; one table a model)."""
    if not paths:
        return None
    meta = read_metadata(paths[0])
    keys = ("token_layers", "count", "realized_share", "max_share", "all_cells", "support",
            "shared", "mean_weight", "mean_rank")  # fmt: skip
    return {k: meta.get(k) for k in keys}
