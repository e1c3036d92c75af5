"""Admission effect: each admission policy (beta > 0) against its exact no-admission twin, by
segment and by bin of tokens since the document start.

Twin: the policy with the same rule, eviction and (for `threshold`) tau, and beta 0
(`moesub.config.is_exact_twin`). Only that pair isolates admission; a pair that also changes the
eviction is never called an admission effect. A policy without its twin among the emulated runs
is named once, in the part's note, with the twin to add (the config parser warns about it too).

Segments and bins (per token, ΔNLL = nll(policy) - nll(twin) at the same stream and position):

- `segment`: `first_document` for a stream's first document (everything before its second
  document start: the cache starts warm there, from the frequency-based initial set),
  `after_change` for every later document (a real topic change with a cache of the previous
  topic's experts);
- `since`: tokens since the document start (since the stream start in the first document);
- bin `boundary` (since = 0): the document's first token, predicted from the previous document,
  so no admission for the new topic can have helped it yet;
- then bins from the `admission_bins` left edges (from 1), dropping edges past the largest
  observed `since`, so that every bin holds tokens; the last bin's label ends at that largest
  value.

Each (segment, bin) mean ΔNLL has a stream bootstrap BCa interval and bias. Totals per pair:
all tokens, each segment, and the profile after a topic change: `after_change_early` (the first
`admission_early_tokens` tokens of a later document, boundary included) and
`after_change_late` (the rest); `profile` says whether the gain is immediate (the early
interval is below 0), late (only the late one is), or neither.

One primary estimand per pair: the mean ΔNLL per token over all tokens (Δppl vs the twin is
the same number on the perplexity scale, 100 (e^ΔNLL - 1)), with its two-sided BCa interval
(streams resampled), the t-based sensitivity interval and the two-sided p-value of 0 that the
interval inverts; the minimum detectable ΔNLL of a two-sided test at `alpha` and `power` over
the per-stream means (normal approximation). Sensitivity line: a two-sided Wilcoxon
signed-rank test on the per-stream mean ΔNLL (it tests a pseudo-median, not the mean).
`quality` and `speed` (`STUDY_ADMISSION`) are the study's pre-registered admission tests; the
other admission policies and the profiles are exploratory (`moesub.stats.multiplicity`).

Entry point: `admission(tokens, emulate, p) -> Admission`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from scipy import stats as sps

from moesub.config import is_exact_twin, twin_spec
from moesub.metrics import dppl_pct
from moesub.stats.intervals import Interval, rng_for, stream_bootstrap
from moesub.stats.load import FileInfo, missing
from moesub.stats.multiplicity import StatTest
from moesub.stats.params import AnalysisParams
from moesub.stats.power import paired_mde, wilcoxon_min_p
from moesub.stats.quality import ratio_stat
from moesub.stats.tokens import Tokens

SEGMENTS = ("first_document", "after_change")
PROFILE = ("after_change_early", "after_change_late")  # totals of the profile after a change
BOUNDARY = "boundary"
STUDY_ADMISSION = ("quality", "speed")  # the study's admission policies (pre-registered tests)


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
    why = f"no exact no-admission twin ({twin_spec(policy)}) among the emulated runs"
    if near:
        verb = "differs" if len(near) == 1 else "differ"
        why += f" ({', '.join(near)} {verb} in eviction or tau, not an admission effect)"
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
    fraction, segment) Δppl vs the twin and, for segment `all`, the primary estimand, its
    test and the profile (`analysis.json["admission"]`); `tests`; `status`."""

    table: pd.DataFrame
    totals: list[dict[str, Any]]
    tests: list[StatTest]
    status: dict[str, Any]


def admission(tokens: Tokens, emulate: list[FileInfo], p: AnalysisParams) -> Admission:
    """Every admission policy emulated (`emu`) against its exact twin; `emulate`: the runs'
    files (their metadata names a policy the config does not)."""
    if not tokens.emulated:
        return Admission(pd.DataFrame(), [], [], missing("no emulate artefacts"))
    meta_by_name = {i.name: i.meta for i in emulate}
    runs = tokens.db.execute(
        "SELECT DISTINCT name, fraction FROM emu ORDER BY name, fraction"
    ).fetchall()
    present: dict[float, list[str]] = {}
    for name, frac in runs:
        present.setdefault(frac, []).append(name)
    rows, totals, tests = [], [], []
    no_twin: dict[str, tuple[str, list[float]]] = {}  # policy -> (why, fractions)
    for frac, names in sorted(present.items()):
        known = {n: p.policy(n, meta_by_name.get(n)) for n in names}
        for name in names:
            pol = known[name]
            if pol is None or pol["beta"] <= 0:
                continue
            twin, why = find_twin(pol, {n: c for n, c in known.items() if n != name})
            if twin is None:
                no_twin.setdefault(name, (str(why), []))[1].append(float(frac))
                continue
            r, t, tt = admission_pair(tokens, name, twin, float(frac), p)
            rows.extend(r)
            totals.extend(t)
            tests.extend(tt)
    notes = []
    for name, (why, fracs) in no_twin.items():
        where = "" if len(fracs) == len(present) else f" at fraction(s) {fracs}"
        notes.append(f"{name} has {why}{where}, so its admission effect is not measured")
        if name in STUDY_ADMISSION:
            tests.append(
                StatTest(
                    kind="admission_study",
                    name=name,
                    hypothesis=HYPOTHESIS,
                    expected=-1,
                    estimand=ESTIMAND,
                    reason=notes[-1],
                    measured=False,
                )
            )
    note = {"note": "; ".join(notes)} if notes else {}
    if rows:
        status = {"status": "ok", **note}
    else:
        why = "no admission policy (beta > 0) with an exact no-admission twin among emulate runs"
        status = {**missing(why), **note}
    return Admission(pd.DataFrame(rows), totals, tests, status)


HYPOTHESIS = "background admission lowers the NLL (the study: perplexity −0.3 to −1.5%)"
ESTIMAND = "mean ΔNLL per token, admission − exact twin"


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
) -> tuple[list[dict], list[dict], list[StatTest]]:
    """Rows per (segment, bin), totals (all, per segment, the profile) and the tests of one
    policy vs its twin."""
    tok = pair_tokens(tokens, name, twin, frac)
    streams, s_idx = np.unique(tok["stream"], return_inverse=True)
    since = tok["since"].astype(np.int64)
    dnll = tok["dnll"].astype(float)
    seg = tok["segment"].astype(np.int64)
    n_s = len(streams)
    if n_s == 0:
        why = f"{name} and {twin} share no token with an NLL at fraction {frac:g}"
        base = {"policy": name, "twin": twin, "fraction": frac, "segment": "all"}
        return [], [{**base, "status": "missing", "reason": why}], []
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
    # totals: all tokens, each segment, then the profile after a change; (S, 5) sums, counts
    seg_sums = sums.reshape(n_s, len(SEGMENTS), n_b).sum(2)
    seg_cnts = cnts.reshape(n_s, len(SEGMENTS), n_b).sum(2)
    early = (seg == 1) & (since < p.admission_early_tokens)
    late = (seg == 1) & ~early
    tot_sums = np.column_stack(
        [seg_sums.sum(1), seg_sums, *(np.bincount(s_idx, dnll * m, n_s) for m in (early, late))]
    )
    tot_cnts = np.column_stack(
        [
            seg_cnts.sum(1),
            seg_cnts,
            *(np.bincount(s_idx, m.astype(float), n_s) for m in (early, late)),
        ]
    )
    tot_iv = stream_bootstrap(
        ratio_stat(tot_sums, tot_cnts, dppl_pct),
        n_s,
        p.n_boot,
        rng_for(p.seed, "admission", "totals", name, frac),
        p.ci_level,
        null=0.0,
    )
    totals = []
    for j, segment in enumerate(("all", *SEGMENTS, *PROFILE)):
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
            **dnll_interval(tot_iv[j] if n else Interval(None)),
            "p_value": tot_iv[j].p_value if n else None,
        }
        if not n:
            total["reason"] = f"no tokens in segment {segment}"
        totals.append(total)
    totals[0].update(stream_tests(tot_sums[:, 0], tot_cnts[:, 0], p))
    totals[0].update(profile(totals[-2], totals[-1], p.admission_early_tokens))
    return rows, totals, pair_tests(totals, p)


def dnll_interval(iv: Interval) -> dict[str, float | None]:
    """The interval of Δppl vs the twin on the ΔNLL scale (`dnll_ci_lo`, ...): the same
    interval, ΔNLL = log(1 + Δppl / 100) being monotone."""

    def back(v: float | None) -> float | None:  # a t bound can pass -100%: no ΔNLL there
        return None if v is None or v <= -100 else float(np.log1p(v / 100.0))

    return {
        "dnll_ci_lo": back(iv.ci_lo),
        "dnll_ci_hi": back(iv.ci_hi),
        "dnll_t_ci_lo": back(iv.t_lo),
        "dnll_t_ci_hi": back(iv.t_hi),
    }


def stream_tests(sums: np.ndarray, cnts: np.ndarray, p: AnalysisParams) -> dict:
    """The primary estimand's MDE and the Wilcoxon sensitivity line over the per-stream means
    (module doc)."""
    d = sums[cnts > 0] / cnts[cnts > 0]  # (S,) per-stream mean ΔNLL vs the twin
    nonzero = int((d != 0).sum())
    out: dict[str, Any] = {
        "test": "mean ΔNLL per token, two-sided, stream bootstrap (the interval it inverts)",
        "alpha": p.alpha,
        "n_test_streams": int(d.size),
        "wilcoxon_p": float(sps.wilcoxon(d).pvalue) if nonzero else None,
        "wilcoxon_min_p": wilcoxon_min_p(nonzero, "two-sided"),
    }
    sd = float(d.std(ddof=1)) if d.size >= 2 else None
    mde = paired_mde(sd, int(d.size), p.alpha, p.power, "two-sided")
    out["mde_dnll"] = mde
    # the same effect as a perplexity reduction, in % of the twin's perplexity
    out["mde_dppl_pct"] = float(-dppl_pct(-mde)) if mde is not None else None
    return out


def profile(early: dict, late: dict, n_early: int) -> dict[str, str]:
    """Is the gain after a topic change immediate (the first `n_early` tokens' interval below
    0), late (only the later tokens'), or neither? From the two profile totals."""

    def below(t: dict) -> bool:
        return t["status"] == "ok" and t["ci_hi"] is not None and t["ci_hi"] < 0

    def above(t: dict) -> bool:
        return t["status"] == "ok" and t["ci_lo"] is not None and t["ci_lo"] > 0

    if below(early):
        kind = "immediate"
    elif below(late):
        kind = "late (the first tokens get worse)" if above(early) else "late"
    else:
        kind = "none detected"
    return {"profile": kind, "early_tokens": n_early}


def pair_tests(totals: list[dict], p: AnalysisParams) -> list[StatTest]:
    """The primary test of one pair (totals[0]) and its two profile tests."""
    first = totals[0]
    pair = f"{first['policy']} vs {first['twin']}"
    primary = first["policy"] in STUDY_ADMISSION
    n_early = first["early_tokens"]
    wil = first.get("wilcoxon_p")
    tests = []
    for t, kind, name in (
        (first, "admission_study" if primary else "admission_other", pair),
        (totals[-2], "admission_profile", f"{pair}, first {n_early} tokens after a change"),
        (totals[-1], "admission_profile", f"{pair}, after the first {n_early} tokens"),
    ):
        ok = t["status"] == "ok"
        tests.append(
            StatTest(
                kind=kind,
                name=name,
                hypothesis=HYPOTHESIS,
                expected=-1,
                estimand=ESTIMAND,
                fraction=t["fraction"],
                estimate=t["dnll_mean"],
                ci_lo=t["dnll_ci_lo"],
                ci_hi=t["dnll_ci_hi"],
                ci_method=f"stream bootstrap, {t['ci_method']}",
                t_ci_lo=t["dnll_t_ci_lo"],
                t_ci_hi=t["dnll_t_ci_hi"],
                p_value=t["p_value"] if ok else None,
                p_method="inverts the bootstrap interval",
                mde=first["mde_dnll"] if t is first else None,
                min_p=1.0 / p.n_boot,
                n_units=t["n_streams"],
                sensitivity=(
                    f"Wilcoxon signed-rank, two-sided, on the {first['n_test_streams']} "
                    f"per-stream mean ΔNLL (a pseudo-median, not the mean): p = {wil:.3g}"
                    if t is first and wil is not None
                    else None
                ),
                reason=None if ok else t.get("reason"),
            )
        )
    return tests
