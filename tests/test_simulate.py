"""Simulator: counters agree with per-stream scans, per-token-layer counts, bad input."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

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


def test_run_simulate_writes_each_token_layers_counts(streams, tmp_path):
    """The counts file holds the scan's per-token-layer counts, stream by stream, in the order
    `moesub.token_counts.stream_counts` reads them back; the table has no time column (the
    price stage prices the counts)."""
    from moesub.artefacts import router_rows
    from moesub.io import write_parquet
    from moesub.policy import token_layer_counts
    from moesub.simulate import run_simulate
    from moesub.token_counts import stream_counts

    router = tmp_path / "router.parquet"
    rows = [router_rows(i + 3, s) for i, s in enumerate(streams)]
    write_parquet(
        pa.concat_tables(rows), router,
        metadata={"num_experts": 64, "top_k": 4, "num_layers": 3, "norm_topk_prob": True},
    )  # fmt: skip
    pol = POLICIES["quality"]
    table, counts = tmp_path / "t.parquet", tmp_path / "c.parquet"
    run_simulate(str(router), None, "quality", pol.to_dict(), 0.25, str(table), str(counts))
    got = stream_counts(pl.read_parquet(counts))
    for s, c in zip(streams, got, strict=True):
        want = token_layer_counts(scan(s, 4, 16, pol))
        np.testing.assert_array_equal(c, want)
    assert "est_time_per_token_s" not in pl.read_parquet(table).columns
