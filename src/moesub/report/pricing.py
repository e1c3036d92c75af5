"""The report's pricing tables: the engine's runs against their pricing on this machine (with the
token-set effect and the runs' CPU share), and a hybrid policy's time with and without the host
computing concurrently under one GPU profile (`moesub.price`'s `priced.parquet`).
"""

from __future__ import annotations

import pandas as pd

from moesub.hardware import STUDY_PROFILE
from moesub.report.load import AnalysisOutputs, finite
from moesub.report.tables import Col, Row, Table, make_table, num, pct, text

# the policies whose host path the concurrency table shows, where simulated
HOST_POLICIES = ("host_compute", "hybrid_015", "llama_cpp_27861")


def ms(key: str) -> Col:
    return Col(f"{key} (ms)", lambda r: num(1e3 * r[key], "{:.3f}") if finite(r.get(key)) else "—")


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
        Col("error at the run's disk speed", lambda r: pct(r.get("rel_error_at_run_disk"))),
        Col(
            "priced, simulator's tokens (ms)",
            lambda r: num(1e3 * r["sim_time_per_token_s"], "{:.3f}"),
        ),  # fmt: skip
        Col("token-set effect", lambda r: pct(r.get("token_set_effect"))),
        Col("CPU share", lambda r: num(r.get("cpu_share"), "{:.2f}")),
        Col("", flag, False),
    ]
    return make_table("sim-engine-table", se.to_dict("records"), cols)


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
