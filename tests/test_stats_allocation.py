"""Planned against uniform slots (moesub.stats.allocation): the pairing by policy fields, the
paired Δppl difference computed by hand, and the simulated time ratio per profile."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from moesub.hardware import STUDY_PROFILE
from moesub.stats import AnalysisParams
from moesub.stats.allocation import allocation, uniform_counterpart
from moesub.stats.load import FileInfo

RULE = {"rule": "threshold", "tau": 0.15, "eviction": "lru"}
POLICIES = {
    "rule_015": RULE,
    "rule_015_planned": {**RULE, "allocation": "planned"},
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "fetch_every_miss_planned": {"rule": "fetch_all", "eviction": "lru", "allocation": "planned"},
}


def params(**kw) -> AnalysisParams:
    return AnalysisParams.from_mapping({"policies": POLICIES, "n_boot": 500, **kw})


def per_stream(rng: np.random.Generator, n_streams: int = 12) -> pd.DataFrame:
    """Per-stream ΔNLL sums: planned loses less than uniform in every stream."""
    rows = []
    for s in range(n_streams):
        n = 100 + 10 * s
        uniform = 0.02 + 0.004 * rng.standard_normal()
        for name, mean in (("rule_015", uniform), ("rule_015_planned", uniform - 0.005)):
            rows.append({"name": name, "fraction": 0.25, "stream": s, "n_nll": n,
                         "sum_dnll": mean * n})  # fmt: skip
        rows.append({"name": "fetch_every_miss", "fraction": 0.25, "stream": s, "n_nll": n,
                     "sum_dnll": 0.0})  # fmt: skip
    return pd.DataFrame(rows)


def quality_table() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"policy": "rule_015", "fraction": 0.25, "dppl_pct": 2.0, "hit_rate": 0.90,
             "sub_rate": 0.10},
            {"policy": "rule_015_planned", "fraction": 0.25, "dppl_pct": 1.5, "hit_rate": 0.91,
             "sub_rate": 0.09},
            {"policy": "fetch_every_miss", "fraction": 0.25, "dppl_pct": 0.0, "hit_rate": 0.89,
             "sub_rate": 0.0},
        ]
    )  # fmt: skip


def infos() -> list[FileInfo]:
    layout = {"rule_015_planned": [145, 154, 105, 108], "rule_015": [128] * 4}
    return [
        FileInfo(f"{n}.parquet", "emulate", 1, {"layout": {"capacities": c}}, n, 0.25)
        for n, c in layout.items()
    ]


def prices() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"hardware": hw, "source": "simulator", "fraction": 0.25, "policy": pol,
             "time_per_token_s": t}
            for hw, times in ((STUDY_PROFILE, (2.0, 1.8)), ("h100_pcie5_server", (1.0, 0.95)))
            for pol, t in zip(("rule_015", "rule_015_planned"), times, strict=True)
        ]
    )  # fmt: skip


def test_uniform_counterpart_by_fields():
    p = params()
    planned = p.policy("rule_015_planned")
    known = {n: p.policy(n) for n in POLICIES if n != "rule_015_planned"}
    assert uniform_counterpart(planned, known) == "rule_015"
    assert uniform_counterpart(planned, {"fetch_every_miss": known["fetch_every_miss"]}) is None
    # a planned policy is never another planned policy's counterpart
    other = {**planned, "eviction": "lru"}
    assert uniform_counterpart(other, {"x": planned}) is None


def test_paired_difference_by_hand_and_time_ratio():
    ps = per_stream(np.random.default_rng(0))
    out = allocation(ps, quality_table(), prices(), infos(), params())
    assert out.status["status"] == "ok"
    # fetch_every_miss_planned was not emulated: nothing to pair, and no note about it
    assert "note" not in out.status
    (row,) = out.table.to_dict("records")
    assert (row["planned"], row["uniform"]) == ("rule_015_planned", "rule_015")
    assert row["planned_slots"] == "145/154/105/108" and row["uniform_slots"] == "128/128/128/128"

    def dppl(name: str) -> float:
        g = ps[ps["name"] == name]
        return 100 * np.expm1(g["sum_dnll"].sum() / g["n_nll"].sum())

    assert row["diff_dppl_pct"] == pytest.approx(dppl("rule_015_planned") - dppl("rule_015"))
    assert row["diff_ci_hi"] < 0 and row["diff_p"] < 0.05  # lower in every stream
    assert row["time_ratio_study"] == pytest.approx(0.9)
    assert (row["time_ratio_min"], row["time_ratio_max"]) == pytest.approx((0.9, 0.95))
    (test,) = out.tests
    assert test.kind == "allocation" and test.expected == -1 and test.n_units == 12


def test_planned_without_its_counterpart_is_named():
    ps = per_stream(np.random.default_rng(1))
    ps = ps[ps["name"] != "rule_015"]
    out = allocation(ps, quality_table(), prices(), infos(), params())
    assert out.status["status"] == "missing"
    assert "rule_015_planned at fraction 0.25" in out.status["note"]
    assert out.table.empty and out.tests == []
