"""The report's pricing tables: the engine's runs against their pricing on this machine (with the
token-set effect and the runs' CPU share), the engine benchmark's outcome against what the pricing
is held to, and a hybrid policy's time with and without the host computing concurrently under one
GPU profile (`moesub.price`'s `priced.parquet`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from moesub.hardware import CONTENDED_BELOW, PRICE_HELD_TO, SHARED_ABOVE, STUDY_PROFILE
from moesub.report.load import AnalysisOutputs, ci_label, finite
from moesub.report.tables import Col, Row, Table, interval, make_table, num, pct, text

# the policies whose host path the concurrency table shows, where simulated
HOST_POLICIES = ("host_compute", "hybrid_015", "llama_cpp_27861")


def ms(key: str) -> Col:
    return Col(f"{key} (ms)", lambda r: num(1e3 * r[key], "{:.3f}") if finite(r.get(key)) else "—")


def pct_interval(r: Row, key: str, kind: str = "ci") -> str:
    """`{key}_{kind}_lo` to `_hi` in %, or a dash where there is none (`tables.interval`)."""
    lo, hi = r.get(f"{key}_{kind}_lo"), r.get(f"{key}_{kind}_hi")
    if not (finite(lo) and finite(hi)):
        return "—"
    return interval(100 * float(lo), 100 * float(hi), "{:+.1f}")


def sim_vs_engine_table(out: AnalysisOutputs) -> Table:
    """Per engine run: measured, its own tokens priced on this_machine, the error (and at the
    disk's speed while the run read), the simulator's tokens priced (token-set effect), the CPU
    share and the contended flag."""
    se = out.table("sim_vs_engine")
    if se.empty or "token_set_effect" not in se.columns:
        return make_table("sim-engine-table", [], [])

    def flag(r: Row) -> str:
        return "contended" if r.get("contended") is True else ""

    cols = [
        Col("model", text("model"), False),
        Col("policy", text("policy"), False),
        Col("fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col("device", text("device"), False),
        Col("engine mean (ms)", lambda r: num(1e3 * r["time_mean_s"], "{:.3f}")),
        Col(
            "priced, engine's tokens (ms)", lambda r: num(1e3 * r["est_time_per_token_s"], "{:.3f}")
        ),  # fmt: skip
        Col("error", lambda r: pct(r.get("rel_error"))),
        Col(
            f"error's {ci_label(out.ci_level)} over its streams (%)",
            lambda r: pct_interval(r, "rel_error"),
            False,
        ),
        Col(
            f"error's {ci_label(out.ci_level)}, rounds left out, calibration refitted (%)",
            lambda r: pct_interval(r, "rel_error", "jk"),
            False,
        ),
        Col("error at the run's disk speed", lambda r: pct(r.get("rel_error_at_run_disk"))),
        Col("error at the run's disk and speed", lambda r: pct(r.get("rel_error_at_run_speed"))),
        Col(
            "priced, simulator's tokens (ms)",
            lambda r: num(1e3 * r["sim_time_per_token_s"], "{:.3f}"),
        ),  # fmt: skip
        Col("token-set effect", lambda r: pct(r.get("token_set_effect"))),
        Col("CPU share", lambda r: num(r.get("cpu_share"), "{:.2f}")),
        Col("other processes (cores)", lambda r: num(r.get("other_cores"), "{:.2f}")),
        Col("", flag, False),
    ]
    return make_table("sim-engine-table", se.to_dict("records"), cols)


def bench_lines(out: AnalysisOutputs, held_to: float = PRICE_HELD_TO) -> list[str]:
    """The engine benchmark's pricing against the criterion it is held to (every policy within
    `held_to` of the engine), said as met or not: as measured, naming the rows outside with
    their disk's drift, then what its intervals say of it (over the rounds, `interval_line`;
    the jackknife with the calibration refitted, `jackknife_line`), then the calibration runs'
    own errors (`calibration_line`), then at each run's disk speed (the disk's drift out), then
    also at each run's own compute speed (the machine's drift out too), then the spread of each
    policy's rounds against their price (`round_spread`)."""
    bench = out.table("engine_bench")
    if bench.empty or "sim_rel_error" not in bench.columns:
        return []
    rows = [r for r in bench.to_dict("records") if finite(r.get("sim_rel_error"))]
    if not rows:
        return []
    bound = f"{100 * held_to:g}%"

    def outside(key: str) -> list[Row]:
        return [r for r in rows if finite(r.get(key)) and abs(r[key]) > held_to]

    def largest(key: str) -> str:
        r = max((r for r in rows if finite(r.get(key))), key=lambda r: abs(r[key]))
        return f"largest |error| {100 * abs(r[key]):.1f}% ({r['policy']})"

    def drift(r: Row) -> str:
        """Where a row's runs read, and its error there."""
        d, at = r.get("disk_vs_calibration"), r.get("sim_rel_error_at_run_disk")
        if not finite(d):
            return ""
        return f" (its runs' disk at {d:.2f}x the calibration's" + (
            f"; {100 * at:+.1f}% at it)" if finite(at) else ")"
        )

    missed = outside("sim_rel_error")
    n = len(rows)
    lines = []
    threads = rows[0].get("threads")  # the runs' torch threads (older tables lack them)
    if finite(threads):
        lines.append(
            f"The bench's runs computed with {threads:g} torch thread{'' if threads == 1 else 's'}"
            " (engine.bench.threads), beside the tier's I/O thread and host worker."
        )
    lines += [
        f"The pricing is held to {bound} of the engine's time for every policy. As measured, "
        f"{n - len(missed)} of {n} policies are within it, {largest('sim_rel_error')}"
        + ("; outside: " if missed else "")
        + "; ".join(f"{r['policy']} {100 * r['sim_rel_error']:+.1f}%{drift(r)}" for r in missed)
        + f": the criterion is {'not met' if missed else 'met'} in this run."
    ]
    ci = ci_label(out.ci_level)
    lead = (
        "Resampling each policy's rounds (stretches of the machine; the calibration held as "
        f"fitted) gives its error a {ci}"
    )
    lines += [
        line
        for line in (interval_line(rows, missed, held_to, "ci", lead),
                     jackknife_line(rows, missed, held_to, ci))
        if line
    ]  # fmt: skip
    calibration = calibration_line(
        out.part("engine_bench").get("calibration_run_errors") or {}, held_to
    )
    if calibration:
        lines.append(calibration)
    key = "sim_rel_error_at_run_disk"
    if any(finite(r.get(key)) for r in rows):
        at_disk = outside(key)
        line = (
            f"At each run's disk speed, {n - len(at_disk)} of {n} are within {bound}, "
            f"{largest(key)}"
        )
        if missed and not {r["policy"] for r in missed} & {r["policy"] for r in at_disk}:
            line += (
                ": the rows outside as measured are within at their runs' disk speed; the "
                "disk's drift between runs, which no profile knows in advance, moved them"
            )
        lines.append(line + ".")
    key = "sim_rel_error_at_run_speed"
    if any(finite(r.get(key)) for r in rows):
        at_speed = outside(key)
        unprobed = [r["policy"] for r in rows if not finite(r.get("run_speed"))]
        lines.append(
            f"At each run's disk and its own speed (its compute timed on its tokens that only "
            f"hit, which prices a policy that only hits at its own times: no error by "
            f"construction), {n - len(at_speed)} of {n} are within {bound}, {largest(key)}"
            + ("; outside: " if at_speed else "")
            + "; ".join(f"{r['policy']} {100 * r[key]:+.1f}%" for r in at_speed)
            + (f"; too few such tokens to probe: {', '.join(unprobed)}" if unprobed else "")
            + "."
        )
    # the machine's noise: each policy's rounds (shares of its tokens) against their price
    spread = [r for r in rows if finite(r.get("round_spread"))]
    if spread:
        widest = max(spread, key=lambda r: r["round_spread"])
        median = float(np.median([r["round_spread"] for r in spread]))
        lines.append(
            f"Between rounds (each runs a share of a policy's tokens), a policy's time over its "
            f"price spread by a median of {100 * median:.1f}% (max - min over their median; "
            f"largest {100 * widest['round_spread']:.1f}%, {widest['policy']}): the machine's "
            f"noise and what the pricing misses in each share"
            + (f", more than the {bound} the pricing is held to" if median > held_to else "")
            + "."
        )
    contended = [r["policy"] for r in rows if r.get("contended") is True]
    if contended:
        lines.append(
            f"Contended runs (less than {CONTENDED_BELOW:.0%} of the CPU they asked for, or other "
            f"processes kept more than {SHARED_ABOVE:g} cores busy beside them): "
            f"{', '.join(contended)}."
        )
    return lines


def run_errors_text(by_run: Mapping[str, float], held_to: float = PRICE_HELD_TO) -> str:
    """A calibration's runs' errors at the profile fitted to them (`run_errors`), as the report
    says them: `name +x.x%` each, those beyond `held_to` flagged; empty where there are none."""
    return ", ".join(
        f"{name} {100 * e:+.1f}%" + (f" (beyond {100 * held_to:g}%)" if abs(e) > held_to else "")
        for name, e in by_run.items()
    )


def sim_vs_engine_lines(out: AnalysisOutputs) -> list[dict[str, Any]]:
    """Each model's pricing-vs-engine result, with its calibration's runs' errors said
    (`calibration_text`, `run_errors_text`)."""
    return [
        {**e, "calibration_text": run_errors_text(e.get("calibration_run_errors") or {})}
        for e in out.doc.get("sim_vs_engine") or []
    ]


def calibration_line(errors: Mapping[str, Mapping[str, float]], held_to: float) -> str:
    """The bench's calibration runs priced at the profile fitted to them, per device (the
    analysis's `calibration_run_errors`, `run_errors_text`): the fit's error on its own runs,
    which a policy doing the same inherits; empty where the bench kept none."""
    said = [
        (f"on {device}, " if len(errors) > 1 else "") + run_errors_text(by_run, held_to)
        for device, by_run in errors.items()
        if by_run
    ]
    if not said:
        return ""
    return (
        "The bench's calibration runs, priced at the profile fitted to them (the fit's error on "
        "its own runs; a policy that does what a run does inherits it): " + "; ".join(said) + "."
    )


def interval_line(rows: list[Row], missed: list[Row], held_to: float, kind: str, lead: str) -> str:
    """What one of the bench's intervals (`kind`: `ci`, over its rounds resampled; `jk`, its
    jackknife with the calibration refitted) says of the criterion, after `lead`: the rows
    outside whose error's interval (`sim_rel_error_{kind}_lo` / `_hi`) reaches inside
    `held_to`, and the rows within whose interval reaches beyond it (`_crosses`, the
    analysis's); empty where the bench has no such interval."""
    key_lo, key_hi, crosses = (f"sim_rel_error_{kind}_{s}" for s in ("lo", "hi", "crosses"))
    rows = [r for r in rows if finite(r.get(key_lo)) and finite(r.get(key_hi))]
    if not rows:
        return ""

    def named(r: Row) -> str:
        error = 100 * r["sim_rel_error"]
        return f"{r['policy']} {error:+.1f}% {pct_interval(r, 'sim_rel_error', kind)}"

    def flagged(r: Row) -> bool:  # a table read back holds NA where there is no interval
        v = r.get(crosses)
        return v is not None and not pd.isna(v) and bool(v)

    def verb(these: list[Row]) -> str:
        return "reaches" if len(these) == 1 else "reach"

    out_names = {r["policy"] for r in missed}
    outside = [r for r in rows if r["policy"] in out_names]
    within = [r for r in rows if r["policy"] not in out_names]
    parts = []
    if outside:
        inside = [r for r in outside if flagged(r)]
        parts.append(
            f"of the {len(outside)} outside, {len(inside)} {verb(inside)} inside {100 * held_to:g}%"
            + (f" ({'; '.join(named(r) for r in inside)}): this run does not tell "
               f"{'it' if len(inside) == 1 else 'them'} from within" if inside else "")
        )  # fmt: skip
    beyond = [r for r in within if flagged(r)]
    parts.append(
        f"of the {len(within)} within, {len(beyond)} {verb(beyond)} beyond it"
        + (f" ({'; '.join(named(r) for r in beyond)})" if beyond else "")
    )
    return lead + ": " + "; ".join(parts) + "."


def jackknife_line(rows: list[Row], missed: list[Row], held_to: float, ci: str) -> str:
    """The jackknife's interval against the criterion (`interval_line`), and how much of its
    variance refitting the calibration alone gives (`calibration_share`, the median over the
    policies); empty where the bench has none."""
    line = interval_line(
        rows, missed, held_to, "jk",
        "Leaving each round out in turn, with the calibration refitted without it (a jackknife "
        f"over the rounds, the calibration's own noise in it), gives the error a {ci}",
    )  # fmt: skip
    shares = [float(r["calibration_share"]) for r in rows if finite(r.get("calibration_share"))]
    if line and shares:
        median = float(np.median(shares))
        line += (
            f" Refitting the calibration alone gives a median {100 * median:.0f}% of that "
            "variance"
            + (" (over 100%: the calibration's noise and the rounds' offset each other)"
               if median > 1 else "")
            + "."
        )  # fmt: skip
    return line


def concurrency_table(out: AnalysisOutputs, profile: str = STUDY_PROFILE) -> Table:
    """The host-computing policies simulated, priced under `profile` with the host computing
    concurrently with the GPU (the profile's own pricing) and after it (the sum)."""
    pr = out.table("priced")
    if pr.empty:
        return make_table("concurrency-table", [], [])
    rows = pr[(pr["hardware"] == profile) & (pr["source"] == "simulator")
              & pr["policy"].isin(HOST_POLICIES)]  # fmt: skip
    rows = rows.assign(gain=rows["time_per_token_serial_s"] / rows["time_per_token_s"])
    cols = [
        Col("model", text("model"), False),
        Col("hardware", text("hardware"), False),
        Col("policy", text("policy"), False),
        Col("fraction", lambda r: num(r.get("fraction"), "{:g}")),
        Col(
            "with concurrency (ms / token)", lambda r: num(1e3 * r["time_per_token_s"], "{:.3f}")
        ),  # fmt: skip
        Col(
            "host after the GPU (ms / token)",
            lambda r: num(1e3 * r["time_per_token_serial_s"], "{:.3f}"),
        ),  # fmt: skip
        Col(
            "host time hidden (ms / token)",
            lambda r: num(1e3 * r["hidden_host_per_token_s"], "{:.3f}"),
        ),  # fmt: skip
        Col("speedup from concurrency", lambda r: num(r.get("gain"), "{:.2f}x")),
    ]
    records = pd.DataFrame(rows).sort_values(["model", "fraction", "policy"]).to_dict("records")
    return make_table("concurrency-table", records, cols)
