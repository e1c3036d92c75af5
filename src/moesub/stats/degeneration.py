"""Degeneration of generated text: per (task, policy, fraction) and measure, over prompts.

Reads the generation artefacts that carry measures (the free continuation task,
`moesub.generate.continuation`; a row's `measures` map, defined in
`moesub.generate.degeneration`). For each of `MEASURES`:

- `mean` over the prompts with its interval at `ci_level`: a stream bootstrap whose units are
  the prompts (BCa, `moesub.stats.intervals`) for the continuous measures, the Wilson score
  interval for the share of continuations that end in a loop (a bootstrap of a share that is 0
  or 1 on every prompt resamples to a zero-width interval); `ci_method` says which;
- against the baseline policy (`fetch_every_miss`) on the same prompts (same problem ids): the
  mean paired difference `diff` with a bootstrap interval over prompts, and a two-sided paired
  test over prompts: the Wilcoxon signed-rank test (zero differences dropped, `n_nonzero`) for
  the continuous measures, the exact sign test over the discordant prompts (McNemar) for the
  loop share. `p_raw` is the test's p-value as computed; `min_p` the smallest p the test could
  reach over these prompts (`moesub.stats.power.wilcoxon_min_p`); `mde` the smallest mean
  difference a two-sided level-`alpha` test over the pairs detects with probability `power`
  (`moesub.stats.power.paired_mde`, a normal-approximation sensitivity figure);
- beside it, the policy's Δppl % with its interval (`moesub.stats.quality`), so that a policy
  whose text loops while its perplexity barely moves is read off one row.

Tests (kind `degeneration`, exploratory: `moesub.stats.multiplicity` adjusts their p with the
family's): per (task, policy, fraction) and measure, the paired test against the baseline, its
name in the row's `test_name`. Its p does not invert the bootstrap interval of `diff` (a rank or
sign test is not a test of the mean), so the record carries no interval: the interval is its
`sensitivity` line.

Entry point: `degeneration(db, runs, quality_table, p) -> Degeneration`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from scipy import stats as sps

from moesub.stats.intervals import Interval, level_label, rng_for, stream_bootstrap, wilson_ci
from moesub.stats.load import FileInfo, missing, sql_list
from moesub.stats.multiplicity import StatTest
from moesub.stats.params import AnalysisParams
from moesub.stats.power import paired_mde, wilcoxon_min_p


class Measure(NamedTuple):
    binary: bool  # a 0/1 outcome per prompt
    what: str  # in words, for the test's name, hypothesis and estimand


# the measures tested, in the report's order
MEASURES = {
    "rep4": Measure(False, "share of repeated 4-grams"),
    "longest_repeat": Measure(False, "longest repeated span (tokens)"),
    "ends_in_loop": Measure(True, "share of continuations ending in a loop"),
}
P_METHODS = {
    "wilcoxon": "Wilcoxon signed-rank over prompts, zero differences dropped, two-sided",
    "sign": "exact sign test over the discordant prompts (McNemar), two-sided",
}


class Degeneration(NamedTuple):
    """`table`: one row per (task, policy, fraction, measure) (module doc); `tests`: the paired
    tests against the baseline; `status`."""

    table: pd.DataFrame
    tests: list[StatTest]
    status: dict[str, Any]


def mean_stat(x: np.ndarray):
    """The mean of per-prompt values under prompt weights w (R, n), for `stream_bootstrap`."""
    return lambda w: (w @ x) / w.sum(axis=1)


def mean_interval(x: np.ndarray, binary: bool, rng: np.random.Generator, p: AnalysisParams):
    """The mean of `x` over prompts with its interval (module doc)."""
    if binary:
        lo, hi = wilson_ci(int(x.sum()), len(x), p.ci_level)
        return Interval(float(x.mean()), lo, hi, None, "wilson", len(x))
    (out,) = stream_bootstrap(mean_stat(x), len(x), p.n_boot, rng, p.ci_level)
    return out


def paired_test(d: np.ndarray, binary: bool) -> dict[str, Any]:
    """Two-sided paired test of the differences `d` (policy - baseline) over prompts."""
    nonzero = int(np.count_nonzero(d))
    out = {"test": "sign" if binary else "wilcoxon", "n_nonzero": nonzero}
    out["min_p"] = wilcoxon_min_p(nonzero, "two-sided")
    if nonzero == 0:
        return out | {"p_raw": 1.0}
    if binary:  # exact sign test over the discordant prompts
        return out | {"p_raw": float(sps.binomtest(int((d > 0).sum()), nonzero, 0.5).pvalue)}
    res = sps.wilcoxon(d, zero_method="wilcox", alternative="two-sided")
    return out | {"p_raw": float(res.pvalue)}


def measure_row(
    x: pd.Series, base: pd.Series | None, measure: str, key: tuple, p: AnalysisParams
) -> dict[str, Any]:
    """The statistics of one measure of one (task, policy, fraction) group; `x` and `base`
    are per-prompt values indexed by problem id."""
    binary = MEASURES[measure].binary
    vals = x.dropna().to_numpy(float)
    row: dict[str, Any] = {"measure": measure, "n": len(vals), "mean": None}
    if len(vals):
        mean = mean_interval(vals, binary, rng_for(p.seed, "degeneration", *key, measure), p)
        row |= {"mean": mean.estimate, **mean.columns()}
    row |= {"baseline_mean": None, "n_pairs": 0, "diff": None, "test": None, "p_raw": None}
    row |= {"mde": None, "test_name": None}
    if base is None:
        return row
    pair = pd.concat([x, base], axis=1, join="inner").dropna()
    d = (pair.iloc[:, 0] - pair.iloc[:, 1]).to_numpy(float)
    row |= {"baseline_mean": float(pair.iloc[:, 1].mean()), "n_pairs": len(d)}
    if len(d) == 0:
        return row
    rng = rng_for(p.seed, "degeneration", "diff", *key, measure)
    (diff,) = stream_bootstrap(mean_stat(d), len(d), p.n_boot, rng, p.ci_level)
    task, policy, _ = key
    row |= {"diff": diff.estimate, **diff.columns("diff_"), **paired_test(d, binary)}
    sd = float(d.std(ddof=1)) if len(d) > 1 else None
    mde = paired_mde(sd, len(d), p.alpha, p.power, "two-sided")
    what = MEASURES[measure].what
    return row | {"mde": mde, "test_name": f"{task}: {policy} {what} vs the baseline"}


def row_test(row: dict[str, Any], p: AnalysisParams) -> StatTest:
    """The paired test of one measure row against the baseline (module doc)."""
    what = MEASURES[row["measure"]].what
    iv = (
        f"[{row['diff_ci_lo']:+.3g}, {row['diff_ci_hi']:+.3g}]"
        if row["diff_ci_lo"] is not None
        else "undefined"
    )
    return StatTest(
        kind="degeneration",
        name=row["test_name"],
        hypothesis=f"substitution raises the {what} of free continuations",
        expected=1,
        estimand=f"mean difference of the {what} (policy − baseline), same prompts",
        fraction=row["fraction"],
        estimate=row["diff"],
        p_value=row["p_raw"],
        p_method=P_METHODS[row["test"]],
        mde=row["mde"],
        min_p=row["min_p"],
        n_units=row["n_pairs"],
        unit="prompts",
        sensitivity=(
            f"mean difference, {level_label(p.ci_level)} prompt bootstrap "
            f"({row['diff_ci_method']}): {iv}"
        ),
    )


def degeneration(
    db: duckdb.DuckDBPyConnection,
    runs: list[FileInfo],
    quality_table: pd.DataFrame,
    p: AnalysisParams,
) -> Degeneration:
    """The degeneration statistics of the generation runs that carry measures (module doc)."""
    runs = [r for r in runs if r.rows and "measures" in pq.read_schema(r.path).names]
    if not runs:
        return Degeneration(pd.DataFrame(), [], missing("no generation artefact with measures"))
    long = db.execute(
        f"""
        SELECT task, policy, fraction, problem_id, e.key AS measure, e.value AS value
        FROM (
            SELECT task, policy, fraction, problem_id, unnest(map_entries(measures)) AS e
            FROM read_parquet({sql_list([r.path for r in runs])}, union_by_name=true)
        )
        WHERE e.key IN ({", ".join(f"'{m}'" for m in MEASURES)})
        """
    ).df()
    if long.empty:
        return Degeneration(pd.DataFrame(), [], missing("no degeneration measures recorded"))
    wide = long.pivot_table(
        index=["task", "policy", "fraction", "problem_id"], columns="measure", values="value",
        dropna=False,
    ).reset_index()  # fmt: skip
    dppl = quality_table.set_index(["policy", "fraction"]) if not quality_table.empty else None
    rows = []
    for (task, name, frac), g in wide.groupby(["task", "policy", "fraction"], sort=True):
        base = wide[
            (wide["task"] == task) & (wide["policy"] == p.baseline) & (wide["fraction"] == frac)
        ].set_index("problem_id")
        g = g.set_index("problem_id")
        own = {"task": task, "policy": name, "fraction": float(frac)}
        if dppl is not None and (name, frac) in dppl.index:
            q = dppl.loc[(name, frac)]
            own |= {k: q.get(k) for k in ("dppl_pct", "dppl_ci_lo", "dppl_ci_hi")}
        for measure in MEASURES:
            if measure not in g.columns:
                continue
            theirs = base[measure] if name != p.baseline and len(base) else None
            rows.append(own | measure_row(g[measure], theirs, measure, (task, name, frac), p))
    table = pd.DataFrame(rows)
    tests = [row_test(r, p) for r in rows if r["test"] is not None]
    status = {"status": "ok"}
    if not (table["policy"] == p.baseline).any():
        status["note"] = f"no {p.baseline} continuation: no paired test"
    return Degeneration(table, tests, status)
