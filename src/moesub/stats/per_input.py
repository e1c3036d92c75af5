"""The mass hypothesis per input: within one policy, does a stream's (or a document's) mean
substituted mass go with its mean ΔNLL? (The study: mass did not predict which inputs lose
quality.)

Per (policy, fraction, level): Pearson r and Spearman rho between per-unit mean mass per
token-layer and mean ΔNLL vs the baseline.

- level `stream`: streams are independent units, so Pearson's p and the Fisher-z interval at
  `ci_level` stand (`ci_method` says so);
- level `document`: documents of one stream share its cache state and its text, so they are not
  independent: the interval resamples streams with all their documents (stream-clustered
  bootstrap, BCa), the p-value is the one that interval inverts, and Spearman's rho has no
  p-value.

Each r with a p-value is an exploratory `per_input` test (`moesub.stats.multiplicity`).

Entry point: `per_input(per_stream, tokens, p) -> PerInput`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from moesub.stats.intervals import correlation, rng_for, stream_bootstrap, weighted_pearson
from moesub.stats.load import missing
from moesub.stats.multiplicity import StatTest, from_interval
from moesub.stats.params import AnalysisParams
from moesub.stats.power import normal_mde
from moesub.stats.tokens import Tokens

FISHER = "Fisher z (streams independent)"


class PerInput(NamedTuple):
    """`table`: per (policy, fraction, level) r between per-unit mass and ΔNLL; `points`: per
    (policy, fraction, level, unit) the mean mass and ΔNLL (and the unit's stream); `tests`;
    `status`."""

    table: pd.DataFrame
    points: pd.DataFrame
    tests: list[StatTest]
    status: dict[str, Any]


def per_input(per_stream: pd.DataFrame, tokens: Tokens, p: AnalysisParams) -> PerInput:
    """Within each policy, r between per-stream (from `per_stream`, `Quality.streams`) or
    per-document (from `emu`, `emu_base`) mean mass and mean ΔNLL (module doc)."""
    if per_stream.empty or not (per_stream["n_nll"] > 0).any():
        why = "needs emulate artefacts and a baseline NLL"
        return PerInput(pd.DataFrame(), pd.DataFrame(), [], missing(why))
    docs = tokens.db.execute(
        """
        SELECT e.name, e.fraction, e.doc_id AS unit, e.stream,
               avg(e.mass) AS mass_per_token_layer, avg(e.nll - b.nll_b) AS dnll_mean,
               count(e.nll - b.nll_b) AS n_nll
        FROM emu e JOIN emu_base b
          ON e.fraction = b.fraction AND e.stream = b.stream AND e.pos = b.pos
        GROUP BY ALL
        """
    ).df()
    docs["level"] = "document"
    streams = per_stream.assign(
        unit=per_stream["stream"],
        mass_per_token_layer=per_stream["sum_mass"] / per_stream["n_tok"],
        dnll_mean=per_stream["sum_dnll"] / per_stream["n_nll"].where(per_stream["n_nll"] > 0),
        level="stream",
    )
    cols = [
        "name",
        "fraction",
        "unit",
        "stream",
        "mass_per_token_layer",
        "dnll_mean",
        "n_nll",
        "level",
    ]
    pts = pd.concat([streams[cols], docs[cols]], ignore_index=True)
    pts = pts[pts["n_nll"] > 0].rename(columns={"name": "policy"})
    pts = pts.sort_values(["policy", "fraction", "level", "unit"], ignore_index=True)
    rows, tests = [], []
    for (name, frac, level), g in pts.groupby(["policy", "fraction", "level"], sort=True):
        if name == p.baseline:
            continue
        row, test = unit_correlation(g, str(name), float(frac), str(level), p)
        rows.append(row)
        tests.extend(test)
    return PerInput(pd.DataFrame(rows), pts, tests, {"status": "ok"})


def fisher_mde(n: int, p: AnalysisParams) -> float | None:
    """The smallest r a two-sided level-alpha test over n independent units detects with
    probability `power` (normal approximation on Fisher's z, standard error 1 / sqrt(n - 3))."""
    return math.tanh(normal_mde(1 / math.sqrt(n - 3), p.alpha, p.power)) if n > 3 else None


def unit_correlation(
    g: pd.DataFrame, name: str, frac: float, level: str, p: AnalysisParams
) -> tuple[dict[str, Any], list[StatTest]]:
    """r of one policy at one level (module doc): its table row and its test (none when r is
    undefined)."""
    x, y = g["mass_per_token_layer"].to_numpy(float), g["dnll_mean"].to_numpy(float)
    corr = correlation(x, y, p.ci_level)
    row = {"policy": name, "fraction": frac, "level": level, **corr, "ci_method": FISHER}
    common = {
        "kind": "per_input",
        "fraction": frac,
        "expected": 1,
        "hypothesis": f"within {name}, {level}s with more mass lose more",
    }
    if corr["r"] is None:
        return row, []
    if level == "stream":
        test = StatTest(
            name=f"{name}: r(mass, ΔNLL) across streams",
            estimand="Pearson r across streams",
            estimate=corr["r"],
            ci_lo=corr["r_ci_lo"],
            ci_hi=corr["r_ci_hi"],
            ci_method=FISHER,
            p_value=corr["p"],
            p_method="Pearson's t test",
            mde=fisher_mde(corr["n"], p),
            n_units=corr["n"],
            **common,
        )
        return row, [test]
    # documents: resample streams, each with all its documents
    stream_ids, of_doc = np.unique(g["stream"].to_numpy(), return_inverse=True)
    rng = rng_for(p.seed, "per_input", name, frac)
    (iv,) = stream_bootstrap(
        lambda w: weighted_pearson(x, y, w[:, of_doc]),
        len(stream_ids),
        p.n_boot,
        rng,
        p.ci_level,
        null=0.0,
    )
    method = f"stream-clustered bootstrap, {iv.method}"
    row.update(r_ci_lo=iv.ci_lo, r_ci_hi=iv.ci_hi, p=iv.p_value, rho_p=None, ci_method=method)
    test = StatTest(
        name=f"{name}: r(mass, ΔNLL) across documents",
        estimand=f"Pearson r across {corr['n']} documents of {len(stream_ids)} streams",
        **{**from_interval(iv), "ci_method": method},
        mde=normal_mde(iv.se, p.alpha, p.power),
        n_units=len(stream_ids),
        **common,
    )
    return row, [test]
