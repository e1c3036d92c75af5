"""The reference study's claims (its findings as the design document lists them) and this
run's verdict on each, computed from the run's numbers: "reproduces", "contradicts", "cannot
decide" or "not measured by this run".

The claims (`CLAIMS`) and what decides each:

- `rule_015`: substituting freely costs far more than the 0.15 rule (study: +5.67% vs +0.35%):
  the pre-registered contrast Δppl(substitute_all) − Δppl(rule_015) > 0 (`dppl_contrast`);
- `mass`: among fetch-first policies, more substituted mass goes with a higher Δppl (study:
  r ~ 0.92): the pre-registered r > 0 (`mass_hypothesis`); the within-cluster r is quoted;
- `expb`: at equal mass, a few heavy substitutions hurt more than many light ones: each
  design's pre-registered two-sided test at its primary m* (`expb_primary`). The study and
  matched designs cannot separate a substitution's rank from its weight (their heavy expert is
  nearly always the better-ranked one); the factorial design can (`expb_factorial_main`,
  pre-registered). The rule (`expb_parts`): when the factorial's rank test finds that the rank
  matters at a fixed weight (evidence against "only the weight matters": Holm p < alpha, either
  sign, since a rank effect can make or mask a heavy-light difference), the designs' results
  may be the rank's: they are quoted beside the verdict, and the factorial's weight test at a
  fixed rank is the claim's one part. Otherwise (no detectable rank effect, the rank test
  invalid or not run) the designs decide and the factorial's tests are quoted beside them: one
  substitution at a fixed rank is another estimand than the equal-mass comparison, so it does
  not overrule the designs;
- `admission`: admission (beta 0.5) cut perplexity 0.3-1.5%: the pre-registered tests of
  `quality` and `speed` against their exact twins (`admission_study`), and their intervals
  against that range;
- `speed`: `quality` and `speed` 2.5-3.0x faster per token than fetch_every_miss at +0.7-1.5%
  perplexity: their speedups (the engine's where it ran them, with the interval of the two
  medians' order-statistic intervals; else the simulator's estimate, which has none) and
  their Δppl intervals against the ranges;
- `host`: `speed` 2.8-3.0x faster than llama.cpp-style host compute (`host_compute`) at equal
  memory: its speedup, as above.

The verdict of a test (direction from its adjusted p, `moesub.stats.multiplicity`): "evidence
against the hypothesis" contradicts; so does an interval wholly outside the study's range where
the claim states one; "supports" reproduces; else cannot decide. A test without a p-value
cannot decide (its reason says why), or is not measured when the run lacks its data. A figure
against a range (no test): an interval wholly outside contradicts, the estimate inside
reproduces, else cannot decide; a figure without an interval is judged by its point. A claim
of several parts (policies, fractions, designs, devices) reproduces when every measured part
does, contradicts when one does and none reproduces, else cannot decide; with no part measured
it is "not measured by this run".

Entry point: `claims(tests, quality, engine, simulate, p) -> Claims`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pandas as pd

from moesub.metrics import dppl_pct, speedup, speedup_text
from moesub.stats.expb_factorial import PREFIX
from moesub.stats.intervals import level_label
from moesub.stats.load import missing
from moesub.stats.multiplicity import AGAINST, NO_EFFECT, SUPPORTS
from moesub.stats.params import AnalysisParams

REPRODUCES = "reproduces"
CONTRADICTS = "contradicts"
UNDECIDED = "cannot decide"
NOT_MEASURED = "not measured by this run"
SPEED_POLICIES = ("quality", "speed")
FACTORIAL_WORDS = {
    f"{PREFIX}weight": "factorial design, the weight at a fixed rank",
    f"{PREFIX}rank": "factorial design, the rank at a fixed weight",
}


@dataclass(frozen=True)
class Claim:
    key: str
    label: str  # short name
    study: str  # what the study found


CLAIMS = (
    Claim(
        "rule_015",
        "the 0.15 rule",
        "substituting freely raised perplexity 5.67%, the 0.15 rule 0.35%: protecting heavy "
        "experts matters more than the count",
    ),
    Claim(
        "mass",
        "the mass hypothesis",
        "among policies that fetch the first choice, more substituted gate mass went with a "
        "higher perplexity increase (Pearson r ~ 0.92)",
    ),
    Claim(
        "expb",
        "Experiment B",
        "at equal substituted mass, a few heavy substitutions hurt more than many light ones",
    ),
    Claim(
        "admission",
        "background admission",
        "admission (beta 0.5) cut perplexity 0.3-1.5%, most right after topic changes",
    ),
    Claim(
        "speed",
        "the quality and speed policies",
        "2.5-3.0× faster per token than fetch_every_miss at +0.7-1.5% perplexity",
    ),
    Claim(
        "host",
        "the speed policy vs llama.cpp",
        "2.8-3.0× faster than llama.cpp-style host compute at equal memory",
    ),
)
ADMISSION_CUT_PCT = (0.3, 1.5)  # the study's perplexity reduction by admission, %
SPEEDUP_RANGE = (2.5, 3.0)  # quality / speed vs fetch_every_miss
SPEED_DPPL_PCT = (0.7, 1.5)
HOST_SPEEDUP_RANGE = (2.8, 3.0)  # speed vs host_compute


class Part(NamedTuple):
    verdict: str
    text: str


class Claims(NamedTuple):
    """`results`: one entry per claim (`analysis.json["claims"]`); `status`."""

    results: list[dict[str, Any]]
    status: dict[str, Any]


def combine(parts: list[Part]) -> str:
    """A claim's verdict from its parts' (module doc)."""
    measured = [q.verdict for q in parts if q.verdict != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED
    if all(v == REPRODUCES for v in measured):
        return REPRODUCES
    if CONTRADICTS in measured and REPRODUCES not in measured:
        return CONTRADICTS
    return UNDECIDED


def outside(lo: float, hi: float, claimed: tuple[float, float]) -> bool:
    return hi < claimed[0] or lo > claimed[1]


def fmt(x: Any, spec: str = "+.3g") -> str:
    return format(float(x), spec) if x is not None and math.isfinite(float(x)) else "—"


def verdict_of_test(
    t: dict[str, Any],
    ci: str,
    claimed: tuple[float, float] | None = None,
    show: Callable[[Any], str] = fmt,
    label: str = "",
) -> Part:
    """One test's verdict (module doc); `claimed`: the study's range in the estimate's units;
    `show` writes a number of the estimate's scale, `label` names that scale."""
    frac = t.get("fraction")
    head = t["name"] + (f" (f {frac:g})" if frac is not None and not pd.isna(frac) else "")
    if t.get("p_value") is None or pd.isna(t["p_value"]):
        if not t.get("measured", True):  # its section says why, once
            return Part(NOT_MEASURED, f"{head}: {NOT_MEASURED}")
        return Part(UNDECIDED, f"{head}: {t.get('reason')}")
    lo, hi = t.get("ci_lo"), t.get("ci_hi")
    has_iv = lo is not None and hi is not None and not (pd.isna(lo) or pd.isna(hi))
    iv = f"[{show(lo)}, {show(hi)}] ({ci})" if has_iv else "(no interval)"
    text = (
        f"{head}: {label}{show(t['estimate'])} {iv}, {t['adjustment']} p = "
        f"{t['p_adjusted']:.2g} (raw {t['p_value']:.2g}): {t['direction']}"
    )
    mde = t.get("mde")
    if t["direction"] == NO_EFFECT and mde is not None and not pd.isna(mde):
        text += f" (MDE {show(abs(mde)).lstrip('+')}, normal approximation)"
    verdict = UNDECIDED
    if t["direction"] == AGAINST:
        verdict = CONTRADICTS
    elif claimed is not None and has_iv and outside(lo, hi, claimed):
        verdict = CONTRADICTS
        size = "larger" if abs(lo + hi) / 2 > max(abs(c) for c in claimed) else "smaller"
        text += (
            f"; the interval lies outside the study's {show(claimed[0])} to {show(claimed[1])} "
            f"(a {size} effect)"
        )
    elif t["direction"] == SUPPORTS:
        verdict = REPRODUCES
    return Part(verdict, text)


def verdict_of_figure(
    head: str,
    est: float | None,
    lo: float | None,
    hi: float | None,
    claimed: tuple[float, float],
    words: str,
) -> Part:
    """A figure against the study's range (module doc); `words`: the figure in words."""
    if est is None or not math.isfinite(est):
        return Part(NOT_MEASURED, f"{head}: not measured by this run")
    has_iv = lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)
    if has_iv and outside(lo, hi, claimed):
        verdict = CONTRADICTS
    elif claimed[0] <= est <= claimed[1]:
        verdict = REPRODUCES
    else:
        verdict = UNDECIDED if has_iv else CONTRADICTS
    return Part(verdict, f"{head}: {words}: {verdict}")


def tests_of(tests: pd.DataFrame, kind: str) -> list[dict[str, Any]]:
    return [] if tests.empty else tests[tests["kind"] == kind].to_dict("records")


def expb_parts(tests: pd.DataFrame, ci: str) -> tuple[list[Part], list[str]]:
    """Experiment B's parts and the lines quoted beside them (module doc: the factorial's rank
    test decides whether the designs or the factorial's weight test judge the claim)."""
    designs = [verdict_of_test(t, ci) for t in tests_of(tests, "expb_primary")]
    main = {  # named in words: the claim's text is read on its own
        t["name"].removeprefix(PREFIX): {**t, "name": FACTORIAL_WORDS[t["name"]]}
        for t in tests_of(tests, "expb_factorial_main")
    }
    rank, weight = main.get("rank"), main.get("weight")
    if rank is None or weight is None or rank["direction"] != AGAINST:
        return designs, [verdict_of_test(t, ci).text for t in main.values()]
    beside = [f"{verdict_of_test(rank, ci).text}, so the designs' heavy − light differences "
              "may be the rank's"]  # fmt: skip
    beside += [f"confounded by the rank: {q.text}" for q in designs]
    return [verdict_of_test(weight, ci)], beside


def speedup_parts(
    policy: str,
    ref: str,
    column: str,
    claimed: tuple[float, float],
    engine: pd.DataFrame,
    sim: pd.DataFrame,
) -> list[Part]:
    """`policy`'s speedup vs `ref` per fraction: the engine's per device (with the interval
    of the two medians' intervals), else the simulator's estimate."""
    study = f"the study's {claimed[0]:g}-{claimed[1]:g}×"
    parts = []
    eng = engine[engine["policy"] == policy] if not engine.empty else engine
    for r in eng.to_dict("records"):
        base = engine[
            (engine["policy"] == ref)
            & (engine["fraction"] == r["fraction"])
            & (engine["device"] == r["device"])
        ]
        x = r.get(column)
        if base.empty or x is None or not math.isfinite(x):
            continue
        b = base.iloc[0]
        lo, hi = b["time_ci_lo"] / r["time_ci_hi"], b["time_ci_hi"] / r["time_ci_lo"]
        words = (
            f"{speedup_text(x, ref)} [{lo:.2f}×, {hi:.2f}×] (engine, {r['device']}; the "
            f"interval of the two medians' intervals) vs {study}"
        )
        parts.append(
            verdict_of_figure(f"{policy} (f {r['fraction']:g})", x, lo, hi, claimed, words)
        )
    if parts or sim.empty:
        return parts or [Part(NOT_MEASURED, f"{policy} vs {ref}: not measured by this run")]
    for frac, g in sim.groupby("fraction"):
        t = g.set_index("policy")["est_time_per_token_s"]
        if policy in t and ref in t:
            x = float(speedup(t[ref], t[policy]))
            words = f"{speedup_text(x, ref)} (simulator estimate, no interval) vs {study}"
            parts.append(verdict_of_figure(f"{policy} (f {frac:g})", x, None, None, claimed, words))
    return parts or [Part(NOT_MEASURED, f"{policy} vs {ref}: not measured by this run")]


def dppl_part(policy: str, quality: pd.DataFrame, claimed: tuple[float, float], ci: str):
    """`policy`'s Δppl interval per fraction against the study's range."""
    rows = quality[quality["policy"] == policy] if not quality.empty else quality
    parts = []
    for r in rows.to_dict("records"):
        words = (
            f"Δppl {fmt(r['dppl_pct'], '+.2f')}% [{fmt(r['dppl_ci_lo'], '+.2f')}, "
            f"{fmt(r['dppl_ci_hi'], '+.2f')}] ({ci}) vs the study's "
            f"+{claimed[0]:g} to +{claimed[1]:g}%"
        )
        parts.append(
            verdict_of_figure(
                f"{policy} (f {r['fraction']:g})",
                r["dppl_pct"],
                r["dppl_ci_lo"],
                r["dppl_ci_hi"],
                claimed,
                words,
            )
        )
    return parts or [Part(NOT_MEASURED, f"{policy}: Δppl not measured by this run")]


def claims(
    tests: pd.DataFrame,
    quality: pd.DataFrame,
    engine: pd.DataFrame,
    sim: pd.DataFrame,
    p: AnalysisParams,
) -> Claims:
    """Every claim's verdict (module doc) from the tests (`multiplicity.family_table`), the
    quality table, the engine table and the simulate totals."""
    ci = f"{level_label(p.ci_level)} CI"
    base, host = p.baseline, p.host_baseline
    cut = tuple(math.log1p(-c / 100) for c in reversed(ADMISSION_CUT_PCT))  # on the ΔNLL scale

    def as_dppl(x: Any) -> str:  # a ΔNLL on the perplexity scale
        return fmt(dppl_pct(float(x)), "+.2f") if x is not None else "—"

    expb, expb_beside = expb_parts(tests, ci)
    parts: dict[str, list[Part]] = {
        "rule_015": [verdict_of_test(t, ci) for t in tests_of(tests, "dppl_contrast")],
        "mass": [verdict_of_test(t, ci) for t in tests_of(tests, "mass_hypothesis")],
        "expb": expb,
        "admission": [
            verdict_of_test(t, ci, cut, as_dppl, "Δppl % ")
            for t in tests_of(tests, "admission_study")
        ],
        "speed": [
            q
            for name in SPEED_POLICIES
            for q in speedup_parts(
                name, base, "speedup_vs_fetch_every_miss", SPEEDUP_RANGE, engine, sim
            )
            + dppl_part(name, quality, SPEED_DPPL_PCT, ci)
        ],
        "host": speedup_parts(
            "speed", host, "speedup_vs_host_compute", HOST_SPEEDUP_RANGE, engine, sim
        ),
    }
    context = {
        "expb": expb_beside,
        "mass": [verdict_of_test(t, ci).text for t in tests_of(tests, "mass_within_clusters")],
        "rule_015": [
            f"{r['policy']} (f {r['fraction']:g}) Δppl {fmt(r['dppl_pct'], '+.2f')}%"
            for r in (quality.to_dict("records") if not quality.empty else [])
            if r["policy"] in ("rule_015", "substitute_all")
        ],
    }
    results = []
    for c in CLAIMS:
        ps = parts[c.key]
        results.append(
            {
                "claim": c.key,
                "label": c.label,
                "study": c.study,
                "verdict": combine(ps),
                "details": "; ".join(q.text for q in ps) or NOT_MEASURED,
                "context": "; ".join(context.get(c.key, [])),
                "parts": [q._asdict() for q in ps],
            }
        )
    if all(r["verdict"] == NOT_MEASURED for r in results):
        return Claims(results, missing("no claim of the study is measured by these artefacts"))
    return Claims(results, {"status": "ok"})
