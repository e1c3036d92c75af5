"""The report's headline after the claim-by-claim verdict (`moesub.report.claims`): the key
numbers as sentences, each starting with its model's name, models in the analysis' order.
Every p-value quoted is the family-adjusted one, the raw one beside it."""

from __future__ import annotations

from typing import Any

from moesub.metrics import speedup_text
from moesub.report.claims import test_of, test_words
from moesub.report.factorial import factorial_headline
from moesub.report.load import AnalysisOutputs, ci_label, finite, lacking
from moesub.report.tables import Row, interval, num


def recommendation_lines(
    docs: list[dict[str, Any]], ci: str, models: list[str] | None = None
) -> list[str]:
    """One sentence per model (in `models`' order) and cache fraction from the recommend
    stage's documents: the fastest policy within the Δppl budget, then the fastest lossless
    one."""

    def speed(c: dict[str, Any], base: str) -> str:
        where = "engine" + (f" on {c['device']}" if c.get("device") else "")
        src = where if c.get("time_source") == "engine" else "simulator estimate"
        t = c.get("time_per_token_s")
        src += f", {1e3 * float(t):.3g} ms per token" if finite(t) else ""
        if c["policy"] == base:
            return f"{base} itself ({src})"
        x = c.get("speedup_vs_fetch_every_miss")
        how = speedup_text(float(x), base) if finite(x) else f"speed vs {base} unknown"
        return f"{c['policy']}: {how} ({src})"

    rank = {m: i for i, m in enumerate(models or [])}
    lines = []
    for d in sorted(docs, key=lambda d: rank.get(str(d.get("model")), len(rank))):
        base, budget = d.get("baseline", "fetch_every_miss"), d.get("dppl_budget_pct")
        if d.get("source") == "trace":
            lines += trace_lines(d, lambda c, base=base: speed(c, base))
            continue
        for e in d["fractions"]:
            at = f"{d['model']}: at {100 * e['fraction']:g}% resident (C = {e['capacity']}) "
            c = e.get("within_budget")
            if c is not None:
                iv = interval(c.get("dppl_ci_lo"), c.get("dppl_ci_hi"), "{:+.2f}")
                text = (
                    f"use {speed(c, base)} at "
                    f"{num(c.get('dppl_pct'), '{:+.2f}')}% perplexity {iv} ({ci})"
                )
            else:
                text = f"no policy is within the {budget:g}% perplexity budget: "
                text += str(e.get("within_budget_reason"))
            ll = e.get("lossless")
            if ll is not None:
                text += f"; lossless: {speed(ll, base)}."
            else:
                text += f"; lossless: none ({e.get('lossless_reason')})."
            lines.append(at + text)
    return lines


def trace_lines(d: dict[str, Any], speed: Any) -> list[str]:
    """A trace model's recommendation sentences: the fastest policy with its hit rate and
    substituted mass (the quality proxy, with the mass hypothesis' r where Δppl was measured)
    and the fastest lossless one."""

    def figures(c: dict[str, Any]) -> str:
        return (
            f"{speed(c)}, hit rate {num(c.get('hit_rate'), '{:.3f}')}, substituted mass "
            f"{num(c.get('substituted_mass'), '{:.3g}')} per token-layer"
        )

    lines = []
    for e in d["fractions"]:
        at = f"{d['model']} (router trace, simulated only): at {100 * e['fraction']:g}% resident "
        at += f"(C = {e['capacity']}) priced on {d.get('hardware')}, "
        proxy = e.get("quality_proxy") or {}
        r = proxy.get("r")
        if r is not None:
            how = f"r = {float(r):.2f} with Δppl % on {proxy.get('from_model')}"
        else:
            how = f"no r: {proxy.get('reason')}"
        c, ll = e.get("fastest"), e.get("lossless")
        text = f"fastest: {figures(c)}" if c else "no simulated policy has a time"
        text += f" (quality proxy: substituted mass, not a measured Δppl; {how})"
        text += f"; lossless (substitutes nothing): {figures(ll)}." if ll else "; lossless: none."
        lines.append(at + text)
    return lines


def sep(words: str) -> str:
    return f", {words}" if words else ""


def who(r: Row) -> str:
    return f"{r.get('model') or 'model'}: "


def mass_lines(out: AnalysisOutputs) -> list[str]:
    """The mass hypothesis per model and fraction: r over its point set, the adjusted p, the
    within-cluster r and substitute_all against the line."""
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    lines = []
    for r in out.doc.get("mass_hypothesis") or []:
        what = f"mass hypothesis (fetch-first policies, cache fraction {r['fraction']:g})"
        left = ", ".join(e["policy"] for e in r.get("excluded") or [])
        points = f"{r['n']} policies" + (f"; left out: {left}" if left else "")
        if r.get("r") is None:
            lines.append(f"{who(r)}{what}: r {r.get('reason')} ({points}).")
            continue
        t = test_of(out, r.get("model"), kind="mass_hypothesis", fraction=r["fraction"])
        line = (
            f"{who(r)}{what}: Pearson r = {r['r']:.3f}, {ci} "
            f"{interval(r.get('r_ci_lo'), r.get('r_ci_hi'))} (streams resampled, policy set "
            f"fixed){sep(test_words(t, alpha))}; over {points}"
        )
        if r.get("within_r") is not None:
            line += (
                f"; within {len(r.get('clusters') or [])} clusters of mass r = "
                f"{r['within_r']:.3f} {interval(r.get('within_r_ci_lo'), r.get('within_r_ci_hi'))}"
            )
        elif r.get("within_reason"):
            line += f"; within-cluster r: {r['within_reason']}"
        lines.append(line + ".")
    return lines


def expb_lines(out: AnalysisOutputs) -> list[str]:
    """Experiment B per model and design at the primary m*: the two-sided statement, then the
    pre-registered one-sided rule's outcome."""
    df = out.table("expb")
    if df.empty or lacking(df, "expb"):  # the figure says which columns are missing
        return []
    df = df.assign(model=df["model"] if "model" in df.columns else "")
    if "primary" in df.columns and df["primary"].astype(bool).any():
        df = df[df["primary"].astype(bool)]
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    lines = []
    for r in out.by_model(df, "design").to_dict("records"):
        where = f"{who(r)}Experiment B, {r['design']} design "
        where += f"(m* {r['target_mass']:g} per token-layer): "
        if not r.get("valid"):  # the analysis's text says why
            lines.append(where + str(r.get("outcome_text") or r.get("outcome") or "invalid"))
            continue
        name = f"{r['design']} design, m* {r['target_mass']:g}"
        t = test_of(out, r.get("model") or None, name=name)
        iv = interval(r.get("effect_ci_lo"), r.get("effect_ci_hi"), "{:+.3g}")
        lines.append(
            where + f"{r.get('effect_label', 'effect')} "
            f"{num(r.get('effect'), '{:+.3g}')} {iv} ({ci}, Hodges-Lehmann over "
            f"{r.get('n_streams')} streams){sep(test_words(t, alpha, '{:.2g}'))}; "
            "pre-registered one-sided rule: "
            f"{r.get('outcome')}; realized heavy {num(r.get('realized_heavy'), '{:.4g}')}, light "
            f"{num(r.get('realized_light'), '{:.4g}')}; mean rank substituted heavy "
            f"{num(r.get('mean_rank_heavy'), '{:.2f}')} vs light "
            f"{num(r.get('mean_rank_light'), '{:.2f}')}."
        )
    return lines


def policy_lines(out: AnalysisOutputs) -> list[str]:
    """Δppl and speed of the study's named policies."""
    ci = ci_label(out.ci_level)
    s = out.table("summary")
    lines = []
    if "policy" not in s.columns:
        return lines
    for name in ("quality", "speed", "rule_015", "substitute_all"):
        for r in out.by_model(s[s["policy"] == name], "fraction").to_dict("records"):
            bits = []
            if finite(r.get("dppl_pct")):
                bits.append(
                    f"Δppl {r['dppl_pct']:+.2f}% {ci} "
                    f"{interval(r.get('dppl_ci_lo'), r.get('dppl_ci_hi'))}"
                )
            for col, ref in (
                ("speedup_vs_fetch_every_miss", out.baseline),
                ("speedup_vs_host_compute", "host_compute"),
            ):
                if finite(r.get(col)):
                    bits.append(speedup_text(float(r[col]), ref) + " (engine)")
            if bits:
                lines.append(
                    f"{who(r)}{name} (cache fraction {r['fraction']:g}): " + ", ".join(bits) + "."
                )
    return lines


def admission_lines(out: AnalysisOutputs) -> list[str]:
    """Each admission policy vs its exact twin: the primary estimand (mean ΔNLL, two-sided),
    its adjusted p and the profile after a topic change."""
    ci = ci_label(out.ci_level)
    alpha = float(out.params.get("alpha", 0.05))
    by_key = {
        (str(r.get("model")), r["policy"], r["fraction"], r["segment"]): r
        for r in out.doc.get("admission") or []
    }
    lines = []
    for (model, policy, frac, segment), r in by_key.items():
        if segment != "all" or not finite(r.get("dnll_mean")):
            continue
        t = test_of(out, r.get("model"), name=f"{policy} vs {r['twin']}", fraction=frac)
        line = (
            f"{who(r)}admission: {policy} vs its exact twin {r['twin']} (cache fraction "
            f"{frac:g}): mean ΔNLL {r['dnll_mean']:+.4f} per token "
            f"{interval(r.get('dnll_ci_lo'), r.get('dnll_ci_hi'), '{:+.4f}')} ({ci}; Δppl "
            f"{num(r.get('dppl_pct_vs_twin'), '{:+.2f}')}%){sep(test_words(t, alpha, '{:.2g}'))}"
        )
        n = r.get("early_tokens")
        early = by_key.get((model, policy, frac, "after_change_early"))
        late = by_key.get((model, policy, frac, "after_change_late"))
        if n and r.get("profile"):
            line += f"; after a topic change, the first {n} tokens {segment_text(early)}, later "
            line += f"{segment_text(late)}: gain {r['profile']}"
        lines.append(line + ".")
    return lines


def segment_text(t: Row | None) -> str:
    """A segment's mean ΔNLL with its interval, or that it has no tokens."""
    if not t or not finite(t.get("dnll_mean")):
        return "(no tokens)"
    iv = interval(t.get("dnll_ci_lo"), t.get("dnll_ci_hi"), "{:+.4f}")
    return f"{float(t['dnll_mean']):+.4f} {iv}"


def headline(out: AnalysisOutputs) -> list[str]:
    """The headline numbers as sentences; every sentence starts with its model's name."""
    return [
        *mass_lines(out),
        *expb_lines(out),
        *factorial_headline(out),
        *policy_lines(out),
        *admission_lines(out),
    ]
