"""The cache-regime statistics on synthetic traces with known answers."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from moesub.capture import run_expert_ranking
from moesub.regime import (
    REFERENCES,
    effective_experts,
    gate_weights_by_rank,
    measure_regime,
    regime_from_files,
    reuse_distances,
    run_regime,
    softmax_entropy,
    verdict,
)


def _routed(selections: list[list[int]], E: int, L: int = 1) -> np.ndarray:
    """(T, L, E) float32 logits whose top-k in every layer is exactly `selections[t]`, the
    first listed expert with the largest logit."""
    T = len(selections)
    z = np.zeros((T, L, E), np.float32)
    for t, sel in enumerate(selections):
        for r, e in enumerate(sel):
            z[t, :, e] = 10.0 - r
    return z


def test_effective_experts_known_values():
    assert effective_experts(np.ones(64)) == pytest.approx(64)
    assert effective_experts(np.r_[5, np.zeros(63)]) == pytest.approx(1)
    assert effective_experts(np.array([[3, 3, 0, 0], [1, 1, 1, 1]])) == pytest.approx([2, 4])
    with pytest.raises(ValueError, match="at least one selection"):
        effective_experts(np.zeros(4))


def test_reuse_distances_by_hand():
    mask = np.zeros((6, 4), bool)
    mask[[0, 1, 4], 0] = True  # expert 0 at tokens 0, 1, 4: distances 1, 3
    mask[[2, 5], 3] = True  # expert 3 at tokens 2, 5: distance 3
    mask[3, 2] = True  # expert 2 once
    dist, first = reuse_distances(mask)
    assert sorted(dist.tolist()) == [1, 3, 3]
    assert first == 3


def test_gate_weights_by_rank_is_renormalized_softmax_in_rank_order():
    z = np.array([[0.0, 3.0, 1.0, 2.0, -5.0]], np.float32)
    w = gate_weights_by_rank(z, 3)
    top = np.array([3.0, 2.0, 1.0])
    expect = np.exp(top) / np.exp(top).sum()
    np.testing.assert_allclose(w[0], expect, rtol=1e-12)


def test_softmax_entropy_uniform_and_peaked():
    assert softmax_entropy(np.zeros((1, 16), np.float32))[0] == pytest.approx(math.log(16))
    assert softmax_entropy(np.array([[0.0, 1e4]], np.float32))[0] == pytest.approx(0, abs=1e-9)


def test_topic_blocks_give_known_hit_rate_and_reuse():
    # E=32, k=2, C=4, initial set {0,1,2,3}. Four "documents" of 10 tokens, each routing
    # every token to one fixed pair of experts outside the initial set: each document misses
    # its pair once (2 misses of 20 calls), so LRU and Belady both hit 0.9.
    E, k, C = 32, 2, 4
    pairs = [[4, 5], [6, 7], [8, 9], [10, 11]]
    sel = [p for p in pairs for _ in range(10)]
    z = _routed(sel, E)
    reg = measure_regime([z], k, C, np.array([[0, 1, 2, 3]]))
    row = reg.layers.filter(pl.col("layer") == 0).row(0, named=True)
    assert row["hit_rate"] == pytest.approx(0.9)
    assert row["belady_hit_rate"] == pytest.approx(0.9)
    assert row["experts_used"] == 8
    assert row["effective_experts"] == pytest.approx(8)
    # 80 selections: 8 first uses, 72 at distance 1
    assert row["reuse_first"] == pytest.approx(8 / 80)
    assert row["reuse_1"] == pytest.approx(72 / 80)
    # logits 10 and 9: rank 2's weight is 1 / (1 + e) >= 0.15 on every token
    assert row["weight_rank1"] == pytest.approx(math.e / (1 + math.e))
    assert row["heavy_lower_ranks"] == pytest.approx(1.0)
    # 8 effective experts < C = 4? no: 8 >= 4, so no collapse
    assert reg.summary["collapsed"] is False


def test_belady_beats_lru_on_a_cyclic_pattern_and_rule015_substitutes_light_misses():
    # k=1, C=2 over a cycle of 3 experts: LRU misses every call after warm-up; Belady hits
    # half of them.
    E, k, C = 8, 1, 2
    sel = [[e] for e in [0, 1, 2] * 20]
    reg = measure_regime([_routed(sel, E)], k, C, np.array([[0, 1]]))
    total = reg.layers.filter(pl.col("layer") == -1).row(0, named=True)
    assert total["hit_rate"] == pytest.approx(2 / 60)  # only the two initial residents
    assert total["belady_hit_rate"] > 0.45
    # k = 1: every miss is a first choice, which the 0.15 rule always fetches
    assert total["rule015_sub_rate"] == 0


def test_layers_and_total_row():
    rng = np.random.default_rng(0)
    streams = [rng.standard_normal((300, 3, 64)).astype(np.float32) for _ in range(3)]
    reg = measure_regime(streams, 4, 16, None)
    t = reg.layers
    assert t["layer"].to_list() == [0, 1, 2, -1]
    per_layer = t.filter(pl.col("layer") >= 0)
    total = t.filter(pl.col("layer") == -1).row(0, named=True)
    # independent routing: hit rate ~ C/E, reuse at distance 1 ~ k/E, near-uniform use
    assert total["hit_rate"] == pytest.approx(16 / 64, abs=0.03)
    assert total["reuse_1"] == pytest.approx(4 / 64, abs=0.01)
    assert total["hit_rate"] == pytest.approx(per_layer["hit_rate"].mean())
    assert total["effective_experts"] == per_layer["effective_experts"].min()
    reuse = [c for c in t.columns if c.startswith("reuse_")]
    np.testing.assert_allclose(t.select(reuse).sum_horizontal().to_numpy(), 1.0)
    weights = [f"weight_rank{r}" for r in range(1, 5)]
    np.testing.assert_allclose(t.select(weights).sum_horizontal().to_numpy(), 1.0)
    assert reg.summary["collapsed"] is False


def test_collapse_is_flagged():
    # every token routes to the same k experts: 2 effective experts < C = 4
    z = _routed([[3, 5]] * 50, 16)
    reg = measure_regime([z], 2, 4, None)
    assert reg.summary["collapsed"] is True
    assert reg.summary["min_effective_experts"] == pytest.approx(2)
    assert reg.summary["verdict"].startswith("collapsed routing")


@pytest.mark.parametrize(
    ("hit", "expect"),
    [(0.93, "comparable to the reference"), (0.85, "between"), (0.7, "below both")],
)
def test_verdict_bands(hit, expect):
    summary = {
        "hit_rate": hit,
        "capacity": 128,
        "num_experts": 512,
        "collapsed": False,
        "min_effective_experts": 200.0,
    }
    line = verdict(summary)
    assert expect in line
    assert "25% resident" in line
    assert str(REFERENCES["hit_rate"][0]) in line


def test_bad_capacity():
    z = _routed([[0, 1]], 8)
    with pytest.raises(ValueError, match="capacity"):
        measure_regime([z], 2, 1, None)
    with pytest.raises(ValueError, match="at least one"):
        measure_regime([], 2, 4, None)


def test_from_files_round_trip(tmp_path):
    from moesub.artefacts import router_writer

    E, k, L = 16, 2, 2
    rng = np.random.default_rng(1)
    meta = {"num_experts": E, "top_k": k, "num_layers": L, "norm_topk_prob": True}
    meta |= {"model": "synthetic", "family": "qwen3_next", "layer_indices": [0, 1]}
    meta |= {"dtype": "float32"}
    from moesub.artefacts import router_rows

    logits = {s: rng.standard_normal((40, L, E)).astype(np.float32) for s in (0, 1)}
    for name in ("eval", "calib"):
        with router_writer(tmp_path / f"{name}.parquet", E, meta, lookahead=False) as w:
            for s, z in logits.items():
                w.write_table(router_rows(s, z))
    run_expert_ranking(tmp_path / "calib.parquet", tmp_path / "init.parquet")
    run_regime(
        str(tmp_path / "eval.parquet"),
        str(tmp_path / "init.parquet"),
        0.25,
        tmp_path / "regime.parquet",
        tmp_path / "regime.json",
    )
    table = pl.read_parquet(tmp_path / "regime.parquet")
    direct = regime_from_files(tmp_path / "eval.parquet", tmp_path / "init.parquet", 0.25)
    assert table.equals(direct.layers)
    assert direct.summary["capacity"] == 4
    assert direct.summary["fraction"] == 0.25


def test_analysis_part_writes_regime_table_and_verdict(tmp_path):
    from moesub.stats import run_analysis
    from moesub.stats.regime import long_table

    rng = np.random.default_rng(2)
    reg = measure_regime([rng.standard_normal((200, 2, 32)).astype(np.float32)], 2, 8, None)
    model_dir = tmp_path / "results" / "toy"
    from moesub.io import write_parquet

    write_parquet(reg.layers, model_dir / "regime.parquet", metadata={"summary": reg.summary})
    doc = run_analysis(
        {"regime": [str(model_dir / "regime.parquet")]}, {"policies": {}}, tmp_path / "out"
    )
    table = pl.read_parquet(tmp_path / "out" / "regime.parquet")
    assert set(table["model"]) == {"toy"}
    assert table.drop("model").equals(long_table(reg.layers, reg.summary["references"]))
    (entry,) = doc["regime"]
    assert entry["model"] == "toy"
    assert entry["verdict"] == reg.summary["verdict"]
    assert entry["hit_rate"] == pytest.approx(reg.summary["hit_rate"])
    assert doc["parts"]["regime"]["status"] == "ok"
