"""Simulator: counters agree with per-stream scans, cost model arithmetic, bad input."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from moesub.cost import CostModel
from moesub.grid import GridPoint, simulate
from moesub.policy import FETCH, FORCED, HIT, HOST, SUB, Policy, scan
from moesub.synthetic import synthetic_logits

POLICIES = {
    "fetch_every_miss": Policy(),
    "rule_015": Policy(rule="threshold", tau=0.15),
    "quality": Policy(rule="threshold", tau=0.15, eviction="lfu", beta=0.5),
    "speed": Policy(rule="first_choice", eviction="lfu", beta=0.5),
    "host_compute": Policy(rule="host_compute"),
    "substitute_all": Policy(rule="substitute_all"),
}


@pytest.fixture(scope="module")
def streams():
    x = synthetic_logits(300, 3, 64, seed=4)
    return [x[:120], x[120:]]


def test_counters_match_scan_per_stream(streams):
    k, frac = 4, 0.25
    C = 16
    rng = np.random.default_rng(0)
    initial = np.stack([rng.permutation(64)[:C] for _ in range(3)]).astype(np.int32)
    grid = [GridPoint(n, p, C, initial, frac) for n, p in POLICIES.items()]
    df = simulate(streams, k, grid, n_threads=3)
    assert df.height == len(grid) * 4
    for name, p in POLICIES.items():
        rs = [scan(s, k, C, p, initial) for s in streams]  # caches restart at every stream
        status = np.concatenate([r.status for r in rs])
        mass = np.concatenate([r.mass for r in rs])
        rows = df.filter(pl.col("policy") == name).sort("layer")
        for row in rows.to_dicts():
            sl = slice(None) if row["layer"] < 0 else row["layer"]
            st = status[:, sl]
            for code, col in ((HIT, "hit"), (FETCH, "fetch"), (SUB, "sub"), (HOST, "host")):
                assert row[col] == (st == code).sum(), (name, row["layer"], col)
            assert row["forced"] == (st == FORCED).sum()
            assert row["mass_mean"] == pytest.approx(mass[:, sl].mean(), abs=1e-12)
            assert row["tokens"] == 300 * (3 if row["layer"] < 0 else 1)
        total = rows.filter(pl.col("layer") == -1).row(0, named=True)
        assert total["mass_per_token"] == pytest.approx(mass.sum(1).mean())


def test_admissions_and_belady_columns(streams):
    df = simulate(streams, 4, [GridPoint.at_fraction(n, p, 0.25, 64) for n, p in POLICIES.items()])
    tot = {r["policy"]: r for r in df.filter(pl.col("layer") == -1).to_dicts()}
    assert tot["quality"]["admissions"] > 0 and tot["rule_015"]["admissions"] == 0
    assert tot["fetch_every_miss"]["belady_hit_rate"] >= tot["fetch_every_miss"]["hit_rate"]
    assert tot["rule_015"]["belady_hit_rate"] is None
    assert tot["host_compute"]["evictions"] == 0


def test_simulation_is_bit_reproducible(streams):
    grid = [GridPoint.at_fraction(n, p, 0.3, 64) for n, p in POLICIES.items()]
    a = simulate(streams, 4, grid, n_threads=1)
    b = simulate(streams, 4, grid, n_threads=4)
    assert a.equals(b)


def test_cost_model_prices_counts():
    cost = CostModel(
        link_bandwidth_Bps=1e9,
        transfer_latency_s=1e-3,
        expert_bytes=1e6,
        expert_compute_s=1e-4,
        host_expert_compute_s=1e-2,
        dense_layer_s=1e-3,
        background_overlap=0.0,
    )
    counts = dict(tokens=20, hit=30, fetch=5, sub=4, host=1, forced=0, admissions=2)
    # per token over 2 layers (10 tokens): dense 2e-3; 39 computed calls -> 3.9e-4;
    # 1 host call -> 1e-3; 5 fetches x 2e-3 -> 1e-3; 2 admissions x 1e-3 -> 2e-4
    expected = 2e-3 + 3.9e-4 + 1e-3 + 1e-3 + 2e-4
    assert cost.time_per_token(counts, 2) == pytest.approx(expected)
    no_share = CostModel(**{**cost.__dict__, "background_overlap": 1.0})
    assert no_share.time_per_token(counts, 2) == pytest.approx(expected - 2e-4)


def test_cost_model_from_json(tmp_path):
    p = tmp_path / "cost.json"
    p.write_text(json.dumps({"link_bandwidth_Bps": 5e9, "dense_layer_s": 1e-4}))
    assert CostModel.from_json(p).link_bandwidth_Bps == 5e9
    p.write_text(json.dumps({"link_bandwith": 5e9}))
    with pytest.raises(ValueError, match="unknown cost-model key.*link_bandwith"):
        CostModel.from_json(p)


def test_bad_simulator_input(streams):
    grid = [GridPoint("f", Policy(), 16)]
    with pytest.raises(ValueError, match="at least one"):
        simulate([], 4, grid)
    with pytest.raises(ValueError, match="same \\(L, E\\)"):
        simulate([streams[0], streams[1][:, :2]], 4, grid)
    bad = streams[0].copy()
    bad[3, 1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        simulate([bad], 4, grid)
    with pytest.raises(ValueError, match="float32"):
        simulate([streams[0].astype(np.float64)], 4, grid)
    with pytest.raises(ValueError, match="grid point 'f': capacity: C=2 is smaller than k=4"):
        simulate(streams, 4, [GridPoint.at_fraction("f", Policy(), 2 / 64, 64)])
    with pytest.raises(ValueError, match="fraction"):
        simulate(streams, 4, [GridPoint.at_fraction("f", Policy(), 1.5, 64)])
    with pytest.raises(ValueError, match="capacity: must be an integer, got 1.5"):
        simulate(streams, 4, [GridPoint("f", Policy(), 1.5)])
    with pytest.raises(ValueError, match=r"grid point 'f': initial: expected shape \(3, 16\)"):
        simulate(streams, 4, [GridPoint("f", Policy(), 16, np.zeros((3, 8), np.int32))])
    with pytest.raises(ValueError, match="at least one grid point"):
        simulate(streams, 4, [])


def test_write_cost_model_applies_overrides(tmp_path):
    from moesub.simulate import write_cost_model

    calib = tmp_path / "calibration.json"
    calib.write_text(json.dumps({"link_bandwidth_Bps": 2e9, "dense_layer_s": 1e-3}))
    cost = write_cost_model(str(calib), {"dense_layer_s": 5e-4}, str(tmp_path / "cost.json"))
    assert (cost.link_bandwidth_Bps, cost.dense_layer_s) == (2e9, 5e-4)
    assert CostModel.from_json(tmp_path / "cost.json") == cost
    with pytest.raises(ValueError, match="unknown cost-model key.*bandwith"):
        write_cost_model(str(calib), {"bandwith": 1}, str(tmp_path / "x.json"))
