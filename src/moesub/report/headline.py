"""The report's headline: the key numbers as sentences, each starting with its model's name."""

from __future__ import annotations

from typing import Any

from moesub.report.experiments import expb_designs
from moesub.report.load import AnalysisOutputs, ci_label, finite
from moesub.report.tables import Row, first, interval, num, power


def recommendation_lines(docs: list[dict[str, Any]], ci: str) -> list[str]:
    """One sentence per model and cache fraction from the recommend stage's documents: the
    fastest policy within the Δppl budget, then the fastest lossless one."""

    def speed(c: dict[str, Any], base: str) -> str:
        where = "engine" + (f" on {c['device']}" if c.get("device") else "")
        src = where if c.get("time_source") == "engine" else "simulator estimate"
        t = c.get("time_per_token_s")
        src += f", {1e3 * float(t):.3g} ms per token" if finite(t) else ""
        if c["policy"] == base:
            return f"{base} itself ({src})"
        x = num(c.get("speedup_vs_fetch_every_miss"), "{:.2f}")
        return f"{c['policy']}: {x}× faster than {base} ({src})"

    lines = []
    for d in docs:
        base, budget = d.get("baseline", "fetch_every_miss"), d.get("dppl_budget_pct")
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


def expb_headline(out: AnalysisOutputs) -> list[str]:
    """Experiment B per model and design at the primary m* (analysis.json's decision text for an
    analysis without designs)."""
    side, _ = expb_designs(out)
    if not side:
        return [
            f"{e.get('model') or 'model'}: Experiment B: {e['decision']['outcome_text']}"
            for e in out.doc.get("expb") or []
            if (e.get("decision") or {}).get("outcome_text")
        ]
    df = out.table("expb")
    df = df.assign(model=df["model"] if "model" in df.columns else "")
    if "primary" in df.columns and df["primary"].astype(bool).any():
        df = df[df["primary"].astype(bool)]
    ci = ci_label(out.ci_level)
    lines = []
    for r in df.sort_values(["model", "design"]).to_dict("records"):
        where = f"{r['model'] or 'model'}: Experiment B, {r['design']} design "
        where += f"(m* {r['target_mass']:g} per token-layer): "
        if not r.get("valid"):  # the analysis's text says why
            lines.append(where + str(r.get("outcome_text") or r.get("outcome") or "invalid"))
            continue
        effect = ""
        if finite(r.get("effect")):
            iv = interval(r.get("effect_ci_lo"), r.get("effect_ci_hi"), "{:+.3g}")
            effect = f"effect heavy − light {float(r['effect']):+.3g} {ci} {iv}; "
        lines.append(
            where + f"{r.get('outcome')}; p = {num(r.get('p_value'))} over {r.get('n_streams')} "
            f"streams ({power(r)}); "
            + effect
            + f"realized heavy {num(r.get('realized_heavy'), '{:.4g}')}, light "
            f"{num(r.get('realized_light'), '{:.4g}')}; support {num(r.get('support'), '{:.3g}')}; "
            f"mean rank substituted heavy {num(r.get('mean_rank_heavy'), '{:.2f}')}"
            f" vs light {num(r.get('mean_rank_light'), '{:.2f}')}."
        )
    return lines


def headline(out: AnalysisOutputs) -> list[str]:
    """The headline numbers as sentences; every sentence starts with its model's name."""
    ci = ci_label(out.ci_level)

    def who(r: Row) -> str:
        return f"{r.get('model') or 'model'}: "

    lines = []
    for r in out.doc.get("mass_hypothesis") or []:
        what = f"mass hypothesis ({r['group']}, cache fraction {r['fraction']:g})"
        if r.get("r") is not None:
            bias = first(r, "bias", "boot_bias", "r_bias")
            lines.append(
                f"{who(r)}{what}: Pearson r = {r['r']:.3f}, bootstrap {ci} "
                f"{interval(first(r, 'ci_lo', 'r_ci_lo'), first(r, 'ci_hi', 'r_ci_hi'))}"
                + (f", bootstrap bias {float(bias):+.3f}" if finite(bias) else "")
                + f", n = {r['n']} policies."
            )
        else:
            lines.append(f"{who(r)}{what}: {r.get('reason')}; n = {r['n']}.")
    lines += expb_headline(out)
    s = out.table("summary")
    for name in ("quality", "speed", "rule_015", "substitute_all"):
        for r in s[s["policy"] == name].to_dict("records") if "policy" in s else []:
            bits = []
            if finite(r.get("dppl_pct")):
                bits.append(
                    f"Δppl {r['dppl_pct']:+.2f}% {ci} "
                    f"{interval(r.get('dppl_ci_lo'), r.get('dppl_ci_hi'))}"
                )
            if finite(r.get("speedup_vs_fetch_every_miss")):
                bits.append(f"{r['speedup_vs_fetch_every_miss']:.2f}× faster than {out.baseline}")
            if finite(r.get("speedup_vs_host_compute")):
                bits.append(f"{r['speedup_vs_host_compute']:.2f}× vs host_compute")
            if bits:
                lines.append(
                    f"{who(r)}{name} (cache fraction {r['fraction']:g}): " + ", ".join(bits) + "."
                )
    for r in out.doc.get("admission") or []:
        if r.get("segment", "all") != "all":
            continue
        if not finite(r.get("dppl_pct_vs_twin")):
            lines.append(f"{who(r)}admission: {r['policy']}: {r.get('reason') or 'no result'}.")
            continue
        p = first(r, "p_value", "p")
        test = f", one-sided p = {num(p)} ({power({**r, 'mde': r.get('mde_dppl_pct')})})"
        lines.append(
            f"{who(r)}admission: {r['policy']} vs its exact twin {r['twin']}: Δppl "
            f"{r['dppl_pct_vs_twin']:+.2f}% {ci} {interval(r.get('ci_lo'), r.get('ci_hi'))}"
            + (f", bootstrap bias {float(r['bias']):+.3f}" if finite(r.get("bias")) else "")
            + (test if p is not None else "")
            + f", over {r['n_tokens']} tokens."
        )
    return lines
