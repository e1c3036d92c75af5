"""Generation statistics: one row per (task, policy, fraction) of every model.

Per group of problems (one generate artefact):

- `n`: problems scored; `n_missing`: problems left unscored (e.g. the sandbox failed for its own
  reasons; `missing_reasons` says why), never counted as wrong; a task that grades no answer
  (the free continuation: `correct` null with no reason) has neither, only agreement and mass
  (its degeneration is `moesub.stats.degeneration`);
- `accuracy` over the scored problems with its Wilson score interval `ci_low`, `ci_high` at
  `ci_level`;
- `agreement`: share of problems whose output equals the exact model's token for token within
  the task's stop cut (both sides cut as scoring cuts), with its Wilson interval;
  `agree_prefix_mean`: mean share of tokens before the first divergence;
- `mass_per_token_layer`: substituted gate mass per token-layer, mean over problems (each
  problem's mean over its scored tokens and the MoE layers);
- against the baseline policy (`baseline`, fetch_every_miss) on the same problems:
  `accuracy_diff`, the exact McNemar p-value over discordant problems (`mcnemar_p`, two-sided),
  and `mdd`: the smallest accuracy drop below the baseline's that a two-sided level-`alpha` test
  over `n` problems detects with probability `power` (`moesub.stats.power.proportion_mde`);
- `mass_agree_rho`: Spearman r between per-problem mass and agreement prefix.

A data file missing for a task (e.g. GSM8K) is reported once per task in the part's note, with
the number of jobs it affected, not once per job.

Tests (exploratory, `moesub.stats.multiplicity`): per (task, policy, fraction) the McNemar test
of the accuracy difference and the Spearman test of r(mass, agreement prefix).

Entry point: `generation(db, runs, p) -> Generation`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import duckdb
import numpy as np
import pandas as pd
from scipy import stats as sps

from moesub.stats.intervals import correlation, wilson_ci
from moesub.stats.load import FileInfo, missing, sql_list
from moesub.stats.multiplicity import StatTest
from moesub.stats.params import AnalysisParams
from moesub.stats.power import proportion_mde

COLUMNS = (
    "task",
    "policy",
    "fraction",
    "problem_id",
    "correct",
    "missing_reason",
    "agree_exact",
    "agree_prefix_frac",
    "mass_per_token_layer",
    "n_scored",
)


def missing_data_notes(meta: list[dict[str, Any]]) -> list[str]:
    """One line per (task, message) from the artefacts' `missing_data` metadata."""
    jobs: dict[tuple[str, str], int] = {}
    for m in meta:
        if m.get("missing_data"):
            key = (str(m.get("task")), str(m["missing_data"]))
            jobs[key] = jobs.get(key, 0) + 1
    return [
        f"{task} not evaluated ({n} job{'s' if n > 1 else ''}): {message}"
        for (task, message), n in sorted(jobs.items())
    ]


def mcnemar_p(correct: np.ndarray, baseline: np.ndarray) -> float | None:
    """Exact two-sided McNemar p-value of paired outcomes (bool arrays, same problems)."""
    b = int(np.sum(correct & ~baseline))
    c = int(np.sum(~correct & baseline))
    if b + c == 0:
        return 1.0 if len(correct) else None
    return float(sps.binomtest(b, b + c, 0.5).pvalue)


def group_row(g: pd.DataFrame, base: pd.DataFrame | None, level: float, alpha: float, power: float):
    """The statistics of one (task, policy, fraction) group of problems (module doc)."""
    scored = g[g["correct"].notna()]
    n, n_all = len(scored), len(g)
    reason = g["missing_reason"].fillna("")
    k = int(scored["correct"].astype(bool).sum())
    a = int(g["agree_exact"].sum())
    reasons = sorted({r for r in reason if r})
    row: dict[str, Any] = {
        "n": n,
        "n_missing": int((g["correct"].isna() & (reason != "")).sum()),
        "missing_reasons": "; ".join(reasons[:3]),
        "n_correct": k,
        "accuracy": k / n if n else None,
        "n_agree": a,
        "agreement": a / n_all if n_all else None,
        "agree_prefix_mean": float(g["agree_prefix_frac"].mean()),
        "mass_per_token_layer": float(g["mass_per_token_layer"].mean()),
        "tokens_mean": float(g["n_scored"].mean()),
    }
    row["ci_low"], row["ci_high"] = wilson_ci(k, n, level)
    row["agreement_ci_low"], row["agreement_ci_high"] = wilson_ci(a, n_all, level)
    row.update(baseline_accuracy=None, accuracy_diff=None, mcnemar_p=None, mdd=None)
    if base is not None:
        pair = scored.merge(
            base[base["correct"].notna()][["problem_id", "correct"]],
            on="problem_id",
            suffixes=("", "_base"),
        )
        if len(pair):
            mine = pair["correct"].astype(bool).to_numpy()
            theirs = pair["correct_base"].astype(bool).to_numpy()
            p0 = float(theirs.mean())
            row["baseline_accuracy"] = p0
            row["accuracy_diff"] = float(mine.mean()) - p0
            row["mcnemar_p"] = mcnemar_p(mine, theirs)
            row["mdd"] = proportion_mde(p0, len(pair), alpha, power)
    corr = correlation(g["mass_per_token_layer"], g["agree_prefix_frac"])
    row.update(
        mass_agree_n=corr["n"],
        mass_agree_rho=corr["rho"],
        mass_agree_p=corr["rho_p"],
        mass_agree_reason=corr["reason"],
    )
    return row


def row_tests(row: dict[str, Any]) -> list[StatTest]:
    """The McNemar and agreement tests of one (task, policy, fraction) row (module doc)."""
    where = {"fraction": row["fraction"], "unit": "problems"}
    tests = []
    if row.get("mcnemar_p") is not None:
        tests.append(
            StatTest(
                kind="generation_accuracy",
                name=f"{row['task']}: {row['policy']} accuracy vs the baseline",
                hypothesis="substitution lowers accuracy",
                expected=-1,
                estimand="accuracy difference (policy − baseline), same problems",
                estimate=row["accuracy_diff"],
                p_value=row["mcnemar_p"],
                p_method="exact McNemar, two-sided",
                mde=row["mdd"],
                n_units=row["n"],
                **where,
            )
        )
    if row.get("mass_agree_p") is not None:
        tests.append(
            StatTest(
                kind="generation_agreement",
                name=f"{row['task']}: {row['policy']} r(mass, agreement)",
                hypothesis="problems with more substituted mass agree less with the exact model",
                expected=-1,
                estimand="Spearman rho of mass and agreement prefix across problems",
                estimate=row["mass_agree_rho"],
                p_value=row["mass_agree_p"],
                p_method="Spearman's test",
                n_units=row["mass_agree_n"],
                **where,
            )
        )
    return tests


class Generation(NamedTuple):
    """`table`: one row per (task, policy, fraction) (module doc); `tests`; `status`."""

    table: pd.DataFrame
    tests: list[StatTest]
    status: dict[str, Any]


def generation(
    db: duckdb.DuckDBPyConnection, runs: list[FileInfo], p: AnalysisParams
) -> Generation:
    """The generation runs' statistics, read through `db`."""
    if not runs:
        return Generation(pd.DataFrame(), [], missing("no generation artefacts"))
    gen = db.execute(
        f"""
        SELECT {", ".join(COLUMNS)}
        FROM read_parquet({sql_list([i.path for i in runs])}, union_by_name=true)
        ORDER BY task, policy, fraction, problem_id
        """
    ).df()
    notes = missing_data_notes([i.meta for i in runs])
    if gen.empty:
        why = "; ".join(notes)
        return Generation(
            pd.DataFrame(),
            [],
            missing("generation artefacts hold no problems" + (f" ({why})" if why else "")),
        )
    rows = []
    for (task, name, frac), g in gen.groupby(["task", "policy", "fraction"], sort=True):
        base = gen[
            (gen["task"] == task) & (gen["policy"] == p.baseline) & (gen["fraction"] == frac)
        ]
        row = {"task": task, "policy": name, "fraction": float(frac)}
        row |= group_row(g, base if len(base) else None, p.ci_level, p.alpha, p.power)
        rows.append(row)
    status = {"status": "ok"}
    if notes:
        status["note"] = "missing data: " + "; ".join(notes)
    tests = [t for r in rows if r["policy"] != p.baseline for t in row_tests(r)]
    return Generation(pd.DataFrame(rows), tests, status)
