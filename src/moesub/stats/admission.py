"""Admission effect: each admission policy (beta > 0) against its no-admission twin, by bin of
tokens since the last document start.

Twin: the no-admission policy (beta 0) with the same rule (and tau for `threshold`) and the
same eviction if one ran; otherwise the same rule/tau with another eviction, `lru` first (then
the gain includes the eviction change: `twin_exact = False` says so). Tokens before a stream's
first doc_start count from the stream start.

Entry point: `admission_part(ctx)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import pairwise
from typing import Any

import numpy as np
import pandas as pd

from moesub.stats.intervals import boot_counts, percentile_ci, rng_for
from moesub.stats.load import Context, missing
from moesub.stats.quality import dppl_pct


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


def admission_part(ctx: Context) -> None:
    ctx.tables["admission"] = pd.DataFrame()
    ctx.results["admission"] = []
    if not ctx.inputs["emulate"]:
        ctx.parts["admission"] = missing("no emulate artefacts")
        return
    info_by_name = {i.name: i for i in ctx.infos["emulate"]}
    runs = ctx.con.execute(
        "SELECT DISTINCT name, fraction FROM emu ORDER BY name, fraction"
    ).fetchall()
    present: dict[float, list[str]] = {}
    for name, frac in runs:
        present.setdefault(frac, []).append(name)
    edges = np.asarray(ctx.p.admission_bins, dtype=np.int64)
    labels = [(f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}") for lo, hi in pairwise(edges)] + [
        f"{edges[-1]}+"
    ]
    rows, totals, skipped = [], [], []
    for frac, names in sorted(present.items()):
        for name in names:
            pol = ctx.policy(name, info_by_name.get(name))
            if pol is None or pol["beta"] <= 0:
                continue
            twin, exact = find_twin(
                pol, {n: ctx.policy(n, info_by_name.get(n)) for n in names if n != name}
            )
            if twin is None:
                skipped.append(f"{name} @ f{frac:g}: no beta=0 policy with rule {pol['rule']}")
                continue
            r, t = _admission_pair(ctx, name, twin, frac, edges, labels)
            for row in r:
                row["twin_exact"] = exact
            t["twin_exact"] = exact
            rows.extend(r)
            totals.append(t)
    ctx.tables["admission"] = pd.DataFrame(rows)
    ctx.results["admission"] = totals
    if totals:
        ctx.parts["admission"] = {"status": "ok"}
        if skipped:
            ctx.parts["admission"]["note"] = "; ".join(skipped)
    else:
        ctx.parts["admission"] = missing(
            "no admission policy (beta > 0) with a no-admission twin among emulate runs"
            + (f" ({'; '.join(skipped)})" if skipped else "")
        )


def _admission_pair(ctx: Context, name, twin, frac, edges, labels):
    tok = ctx.con.execute(
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
    w = boot_counts(n_s, ctx.p.n_boot, rng_for(ctx.p.seed, "admission", name, frac))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = (w @ sums) / (w @ cnts)  # (B, bins)
        tot_b = dppl_pct((w @ sums.sum(1)) / (w @ cnts.sum(1)))
    rows = []
    for b in range(n_b):
        n = int(cnts[:, b].sum())
        if n == 0:
            continue
        lo, hi = percentile_ci(boot[:, b], ctx.p.ci_level)
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
    lo, hi = percentile_ci(tot_b, ctx.p.ci_level)
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
