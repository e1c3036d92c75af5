"""Admission effect: each admission policy (beta > 0) against its exact no-admission twin, by
segment and by bin of tokens since the document start.

Twin: the policy with the same rule, eviction and (for `threshold`) tau, and beta 0
(`moesub.config.is_exact_twin`). Only that pair isolates admission; a pair that also changes the
eviction is never called an admission effect: such a policy is reported missing, with the reason
and the twin to add to the config.

Segments and bins (per token, ΔNLL = nll(policy) - nll(twin) at the same stream and position):

- `segment`: `first_document` for a stream's first document (everything before its second
  document start: the cache starts cold there), `after_change` for every later document (a real
  topic change with a warm cache);
- `since`: tokens since the document start (since the stream start in the first document);
- bin `boundary` (since = 0): the document's first token, predicted from the previous document,
  so no admission for the new topic can have helped it yet;
- then bins from the `admission_bins` left edges (from 1), dropping edges past the largest
  observed `since`, so that every bin holds tokens; the last bin's label ends at that largest
  value.

Each (segment, bin) mean ΔNLL has a stream bootstrap BCa interval and bias; each pair's totals
(all tokens, and per segment) give Δppl vs the twin with its interval. Test per pair: a one-sided
Wilcoxon signed-rank over streams of the per-stream mean ΔNLL (alternative: admission lowers
the NLL) at `alpha`, with the smallest p the design can reach and the minimum detectable
ΔNLL (and Δppl reduction) at `power`.

Entry point: `admission(tokens, emulate, p) -> Admission`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from scipy import stats as sps

from moesub.config import is_exact_twin, missing_admission_twins, twin_spec
from moesub.metrics import dppl_pct
from moesub.stats.intervals import rng_for, stream_bootstrap
from moesub.stats.load import FileInfo, missing
from moesub.stats.params import AnalysisParams
from moesub.stats.power import paired_mde, wilcoxon_min_p
from moesub.stats.quality import ratio_stat
from moesub.stats.tokens import Tokens

SEGMENTS = ("first_document", "after_change")
BOUNDARY = "boundary"


def find_twin(
    policy: Mapping[str, Any], candidates: Mapping[str, Mapping[str, Any] | None]
) -> tuple[str | None, str | None]:
    """The exact no-admission twin of an admission policy among `candidates` (name -> policy
    dict or None when unknown). Returns (name, None), or (None, why there is none)."""
    pool = sorted(n for n, c in candidates.items() if c is not None and is_exact_twin(policy, c))
    if pool:
        return pool[0], None
    near = sorted(
        n
        for n, c in candidates.items()
        if c is not None and c["beta"] == 0 and c["rule"] == policy["rule"]
    )
    why = f"no exact twin {twin_spec(policy)} ran"
    if near:
        why += f" ({', '.join(near)} differ in eviction or tau: not an admission effect)"
    return None, why


def bin_edges(edges: tuple[int, ...], max_since: int) -> tuple[np.ndarray, list[str]]:
    """Left edges (from 1) kept up to `max_since`, and the labels of all bins, boundary first."""
    kept = np.asarray([e for e in edges if e <= max_since], dtype=np.int64)
    labels = [BOUNDARY]
    for i, lo in enumerate(kept):
        hi = kept[i + 1] - 1 if i + 1 < kept.size else max_since
        labels.append(f"{lo}" if hi == lo else f"{lo}-{hi}")
    return kept, labels


def bin_of(since: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Bin index per token: 0 = boundary (since 0), i >= 1 = [kept[i-1], kept[i])."""
    return np.where(since == 0, 0, np.searchsorted(kept, since, side="right"))


class Admission(NamedTuple):
    """`table`: per (policy, fraction, segment, bin) ΔNLL vs the twin; `totals`: per (policy,
    fraction, segment) Δppl vs the twin and, for segment `all`, the test
    (`analysis.json["admission"]`); `status`."""

    table: pd.DataFrame
    totals: list[dict[str, Any]]
    status: dict[str, Any]


def admission(tokens: Tokens, emulate: list[FileInfo], p: AnalysisParams) -> Admission:
    """Every admission policy emulated (`emu`) against its exact twin; `emulate`: the runs'
    files (their metadata names a policy the config does not)."""
    if not tokens.emulated:
        return Admission(pd.DataFrame(), [], missing("no emulate artefacts"))
    meta_by_name = {i.name: i.meta for i in emulate}
    runs = tokens.db.execute(
        "SELECT DISTINCT name, fraction FROM emu ORDER BY name, fraction"
    ).fetchall()
    present: dict[float, list[str]] = {}
    for name, frac in runs:
        present.setdefault(frac, []).append(name)
    rows, totals, skipped = [], [], []
    for frac, names in sorted(present.items()):
        known = {n: p.policy(n, meta_by_name.get(n)) for n in names}
        for name in names:
            pol = known[name]
            if pol is None or pol["beta"] <= 0:
                continue
            twin, why = find_twin(pol, {n: c for n, c in known.items() if n != name})
            if twin is None:
                skipped.append(f"{name} @ f{frac:g}: {why}")
                totals.append(
                    {
                        "policy": name,
                        "twin": None,
                        "fraction": float(frac),
                        "segment": "all",
                        "status": "missing",
                        "reason": why,
                    }
                )
                continue
            r, t = admission_pair(tokens, name, twin, float(frac), p)
            rows.extend(r)
            totals.extend(t)
    config_notes = missing_admission_twins(p.policies) if p.policies else []
    notes = "; ".join(skipped + [f"config: {m}" for m in config_notes])
    if rows:
        status = {"status": "ok", "note": notes} if notes else {"status": "ok"}
    else:
        status = missing(
            "no admission policy (beta > 0) with an exact no-admission twin among emulate runs"
            + (f" ({notes})" if notes else "")
        )
    return Admission(pd.DataFrame(rows), totals, status)


def pair_tokens(tokens: Tokens, name: str, twin: str, frac: float) -> dict[str, np.ndarray]:
    """Per token with both NLLs (`emu`): stream, segment (0 first document, 1 after a change),
    since, dnll = nll(name) - nll(twin)."""
    return tokens.db.execute(
        """
        WITH a AS (
          SELECT stream, pos, nll, doc_start, min(pos) OVER (PARTITION BY stream) AS first_pos
          FROM emu WHERE name = $name AND fraction = $frac),
        b AS (
          SELECT *, sum(CASE WHEN doc_start AND pos > first_pos THEN 1 ELSE 0 END) OVER
                      (PARTITION BY stream ORDER BY pos ROWS UNBOUNDED PRECEDING) AS change
          FROM a),
        s AS (SELECT *, pos - min(pos) OVER (PARTITION BY stream, change) AS since FROM b)
        SELECT s.stream, CASE WHEN s.change = 0 THEN 0 ELSE 1 END AS segment, s.since,
               s.nll - t.nll AS dnll
        FROM s JOIN emu t
          ON t.name = $twin AND t.fraction = $frac AND t.stream = s.stream AND t.pos = s.pos
        WHERE s.nll IS NOT NULL AND t.nll IS NOT NULL
        ORDER BY s.stream, s.pos
        """,
        {"name": name, "twin": twin, "frac": frac},
    ).fetchnumpy()


def admission_pair(
    tokens: Tokens, name: str, twin: str, frac: float, p: AnalysisParams
) -> tuple[list[dict], list[dict]]:
    """Rows per (segment, bin) and totals (all, per segment) of one policy vs its twin."""
    tok = pair_tokens(tokens, name, twin, frac)
    streams, s_idx = np.unique(tok["stream"], return_inverse=True)
    since = tok["since"].astype(np.int64)
    dnll = tok["dnll"].astype(float)
    seg = tok["segment"].astype(np.int64)
    n_s = len(streams)
    if n_s == 0:
        why = f"{name} and {twin} share no token with an NLL at fraction {frac:g}"
        base = {"policy": name, "twin": twin, "fraction": frac, "segment": "all"}
        return [], [{**base, "status": "missing", "reason": why}]
    kept, labels = bin_edges(p.admission_bins, int(since.max()))
    n_b = len(labels)
    cell = seg * n_b + bin_of(since, kept)  # (segment, bin) per token
    n_cells = len(SEGMENTS) * n_b
    flat = s_idx * n_cells + cell
    sums = np.bincount(flat, dnll, n_s * n_cells).reshape(n_s, n_cells)  # (S, cells)
    cnts = np.bincount(flat, None, n_s * n_cells).reshape(n_s, n_cells).astype(float)
    cell_iv = stream_bootstrap(
        ratio_stat(sums, cnts),
        n_s,
        p.n_boot,
        rng_for(p.seed, "admission", "bins", name, frac),
        p.ci_level,
    )
    rows = []
    for c in range(n_cells):
        n = int(cnts[:, c].sum())
        if n == 0:
            continue
        s, b = divmod(c, n_b)
        rows.append(
            {
                "policy": name,
                "twin": twin,
                "fraction": frac,
                "segment": SEGMENTS[s],
                "bin": b,
                "bin_lo": 0 if b == 0 else int(kept[b - 1]),
                "bin_hi": 0 if b == 0 else int(kept[b] - 1 if b < kept.size else since.max()),
                "bin_label": labels[b],
                "n_tokens": n,
                "n_streams": int((cnts[:, c] > 0).sum()),
                "dnll_mean": cell_iv[c].estimate,
                **cell_iv[c].columns(),
            }
        )
    # totals: all tokens, then each segment; (S, 3) sums and counts
    seg_sums = sums.reshape(n_s, len(SEGMENTS), n_b).sum(2)
    seg_cnts = cnts.reshape(n_s, len(SEGMENTS), n_b).sum(2)
    tot_sums = np.column_stack([seg_sums.sum(1), seg_sums])
    tot_cnts = np.column_stack([seg_cnts.sum(1), seg_cnts])
    tot_iv = stream_bootstrap(
        ratio_stat(tot_sums, tot_cnts, dppl_pct),
        n_s,
        p.n_boot,
        rng_for(p.seed, "admission", "totals", name, frac),
        p.ci_level,
    )
    totals = []
    for j, segment in enumerate(("all", *SEGMENTS)):
        n = int(tot_cnts[:, j].sum())
        total = {
            "policy": name,
            "twin": twin,
            "fraction": frac,
            "segment": segment,
            "status": "ok" if n else "missing",
            "n_tokens": n,
            "n_streams": int((tot_cnts[:, j] > 0).sum()),
            "dnll_mean": float(tot_sums[:, j].sum() / n) if n else None,
            "dppl_pct_vs_twin": tot_iv[j].estimate if n else None,
            **tot_iv[j].columns(),
        }
        if not n:
            total["reason"] = f"no tokens in segment {segment}"
        if segment == "all":
            total.update(admission_test(tot_sums[:, 0], tot_cnts[:, 0], p.alpha, p.power))
        totals.append(total)
    return rows, totals


def admission_test(sums: np.ndarray, cnts: np.ndarray, alpha: float, power: float) -> dict:
    """One-sided Wilcoxon over streams of the per-stream mean ΔNLL (admission lowers the NLL),
    with the smallest reachable p and the minimum detectable effect (module doc)."""
    d = sums[cnts > 0] / cnts[cnts > 0]  # (S,) per-stream mean ΔNLL vs the twin
    nonzero = int((d != 0).sum())
    out: dict[str, Any] = {
        "test": "Wilcoxon signed-rank, one-sided (admission lowers the NLL), over streams",
        "alpha": alpha,
        "n_test_streams": int(d.size),
        "min_p": wilcoxon_min_p(nonzero, "less"),
        "p_value": None,
    }
    if nonzero:
        out["p_value"] = float(sps.wilcoxon(d, alternative="less").pvalue)
    mde = paired_mde(float(d.std(ddof=1)) if d.size >= 2 else None, int(d.size), alpha, power)
    out["mde_dnll"] = mde
    # the same effect as a perplexity reduction, in % of the twin's perplexity
    out["mde_dppl_pct"] = float(-dppl_pct(-mde)) if mde is not None else None
    return out
