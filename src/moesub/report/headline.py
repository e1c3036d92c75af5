"""The report's headline after the claim-by-claim verdict (`moesub.report.claims`): the key
numbers as sentences, each starting with its model's name, models in the analysis' order.
Every p-value quoted is the family-adjusted one, the raw one beside it."""

from __future__ import annotations

from moesub.metrics import speedup_text
from moesub.report.claims import test_of, test_words
from moesub.report.factorial import factorial_headline
from moesub.report.load import AnalysisOutputs, ci_label, finite, lacking
from moesub.report.tables import Row, interval, num


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
