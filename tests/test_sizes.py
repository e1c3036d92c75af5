"""Cache sizes, pin specs, layouts and planned allocations (moesub.slots, moesub.layout,
moesub.allocation, moesub.config's sizes): hand-computed budgets, the one layout resolver, the
allocation's exact split against brute force on small cases."""

from __future__ import annotations

import itertools
import json

import numpy as np
import polars as pl
import pytest
from fixtures_artefacts import write_ranking

from moesub import config as mcfg
from moesub.allocation import best_split, capacity_range, is_concave, run_allocation
from moesub.artefacts import router_rows, router_writer
from moesub.io import read_metadata
from moesub.layout import build_layout, read_allocation
from moesub.policy import Policy, scan
from moesub.simulate import run_simulate
from moesub.slots import (
    REFERENCE_GEOMETRY,
    CacheSize,
    budget_bytes,
    budget_slots,
    min_layer_capacity,
    pin_count,
    resolve_size,
)
from moesub.token_counts import stream_counts

# --------------------------------------------------------------------------------------------
# sizes and budgets


def test_budget_slots_hand_computed():
    # one expert of the reference model at 4.5 bits: 3 x 2048 x 512 x 4.5 / 8 = 1,769,472 B;
    # 10 GiB = 10,737,418,240 B buys 6068.1 experts, 126.4 per layer over 48 layers -> 126
    assert REFERENCE_GEOMETRY.expert_bytes(4.5) == 1_769_472
    assert budget_bytes("10GiB") == 10_737_418_240
    assert budget_slots(budget_bytes("10GiB"), REFERENCE_GEOMETRY, 4.5) == 126
    # bf16: 6 MiB per expert; 6 GiB = 1024 experts, 21.3 per layer -> 21
    assert budget_slots(budget_bytes("6GiB"), REFERENCE_GEOMETRY, 16) == 21
    # exactly on a boundary: 48 x 126 experts at 4.5 bits, one byte less buys one slot less
    exact = 48 * 126 * 1_769_472
    assert budget_slots(exact, REFERENCE_GEOMETRY, 4.5) == 126
    assert budget_slots(exact - 1, REFERENCE_GEOMETRY, 4.5) == 125
    assert budget_bytes("1.5GiB") == 1_610_612_736 and budget_bytes("500MB") == 500_000_000
    for bad in ("10 GiB", "10gb", "GiB", "-1GiB", 10):
        with pytest.raises(ValueError, match="expected a number and a unit"):
            budget_bytes(bad)
    size = resolve_size("10GiB", 512, REFERENCE_GEOMETRY, 4.5)
    assert (size.label, size.capacity, size.fraction) == ("b10GiB", 126, 126 / 512)
    assert size.budget["pricing"]["source"].startswith("reference geometry Qwen3-Next-80B-A3B")
    assert size.budget["expert_bytes"] == 1_769_472 and size.budget["expert_bits"] == 4.5
    assert resolve_size(0.25, 512, None, 16) == CacheSize("f0.25", 128, 0.25)
    assert CacheSize.of(size.to_dict(), 512) == size
    assert CacheSize.of(1.0, 64) == CacheSize("f1", 64, 1.0)
    with pytest.raises(ValueError, match="resolved size with keys"):
        CacheSize.of({"capacity": 3}, 64)


def _checkpoint(tmp_path, **cfg):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "tokenizer.json").write_text("{}")
    return ckpt


def test_model_sizes_price_a_checkpoint_by_its_own_config(tmp_path):
    # 4 decoder layers, the first dense (mlp_only_layers): 3 MoE layers of 8 experts of
    # 3 x 64 x 32 weights; at 8 bits an expert is 6144 B, 36 KiB = 6 experts = 2 per layer
    ckpt = _checkpoint(
        tmp_path, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, mlp_only_layers=[0],
        hidden_size=64, moe_intermediate_size=32,
    )  # fmt: skip
    cfg = {"models": {"m": {"path": str(ckpt)}}, "fractions": [0.5], "budgets": ["36KiB"],
           "expert_bits": 8}  # fmt: skip
    pricing = mcfg.pricing_geometry(cfg, "m")
    assert (pricing.moe_layers, pricing.hidden, pricing.width) == (3, 64, 32)
    assert "config.json of models.m.path" in pricing.source
    sizes = mcfg.model_sizes(cfg, "m")
    assert [(s.label, s.capacity) for s in sizes.values()] == [("f0.5", 4), ("b36KiB", 2)]
    cfg["models"]["m"]["expert_bits"] = 4  # the model's own precision: twice the slots, 4 =
    with pytest.raises(ValueError, match="C=4 slots per layer, as fractions.0.=0.5 does"):
        mcfg.model_sizes(cfg, "m")  # f0.5's C: one size twice
    cfg["budgets"] = ["24KiB"]  # 3 KiB experts: 8 experts, 2 per layer
    assert mcfg.model_sizes(cfg, "m")["b24KiB"].capacity == 2
    # every fourth decoder layer sparse (decoder_sparse_step): layers 3 and 7 of 8
    ckpt = _checkpoint(
        tmp_path, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=8,
        decoder_sparse_step=4, hidden_size=64, intermediate_size=32,
    )  # fmt: skip
    sparse = mcfg.pricing_geometry(cfg, "m")
    assert (sparse.moe_layers, sparse.num_experts, sparse.width) == (2, 8, 32)


def test_stage_sizes_and_regime_size():
    cfg = {"models": {"e": {"embedded": True}}, "embedded": {"num_experts": 64,
           "num_experts_per_tok": 4}, "fractions": [0.5, 0.125], "budgets": ["4.5GiB"],
           "emulate": {"sizes": ["4608MiB", 0.125]}, "engine": {"sizes": None}}  # fmt: skip
    # 4.5 GiB = 4608 MiB: 768 bf16 experts of the reference, 16 per layer: the same size
    assert mcfg.size_labels(cfg) == ["f0.5", "f0.125", "b4.5GiB"]
    sizes = mcfg.stage_sizes(cfg)
    assert sizes["simulate"] == sizes["engine"] == sizes["generate"] == mcfg.size_labels(cfg)
    assert sizes["emulate"] == ["b4.5GiB", "f0.125"]
    # the regime: the configured size nearest 25% resident (C = 16 of 64), or regime.size
    assert mcfg.regime_size(cfg, "e").label == "b4.5GiB"
    cfg["regime"] = {"size": 0.75}
    assert mcfg.regime_size(cfg, "e") == CacheSize("f0.75", 48, 0.75)


# --------------------------------------------------------------------------------------------
# pin specs and layouts


def test_pin_specs():
    assert [pin_count("50%", c, 4) for c in (4, 7, 8, 16)] == [2, 3, 4, 8]
    assert [pin_count("C-k", c, 4) for c in (4, 7, 16)] == [0, 3, 12]
    assert pin_count("C-2", 16, 4) == 14 and pin_count("12.5%", 16, 4) == 2
    assert pin_count(5, 16, 4) == 5 and pin_count("0%", 16, 4) == 0
    for bad in ("half", "150%", "C-", "C+k", -1, 1.5, True):
        with pytest.raises(ValueError, match="not a pin spec"):
            pin_count(bad, 16, 4)
    # the smallest layer a spec allows: pin_l + max(k, prefetch) <= C_l
    assert min_layer_capacity(0, 4, 0, 64) == 4 and min_layer_capacity(0, 4, 6, 64) == 6
    assert min_layer_capacity("50%", 4, 0, 64) == 7  # floor(7 / 2) + 4 = 7
    assert min_layer_capacity("C-k", 4, 0, 64) == 4
    assert min_layer_capacity("C-k", 4, 5, 64) is None  # C - k + 5 > C always
    assert min_layer_capacity(61, 4, 0, 64) is None


def test_build_layout_is_the_ranking_prefix_with_pins():
    rng = np.random.default_rng(0)
    ranking = np.stack([rng.permutation(16) for _ in range(3)])  # (L, E)
    uniform = build_layout(ranking, 0.5, {"rule": "fetch_all", "pin": "50%"}, 4)
    assert uniform.capacities == (8, 8, 8) and uniform.pins == (4, 4, 4) and uniform.uniform
    np.testing.assert_array_equal(uniform.initial_array(), ranking[:, :8])
    assert uniform.pin() == 4 and uniform.to_dict()["size"]["label"] == "f0.5"
    planned = build_layout(ranking, 0.5, {"rule": "fetch_all", "pin": "50%",
                                          "allocation": "planned"}, 4, [7, 9, 8])  # fmt: skip
    assert planned.capacities == (7, 9, 8) and planned.pins == (3, 4, 4)
    assert planned.pin() == (3, 4, 4) and not planned.uniform
    for layer, c in enumerate((7, 9, 8)):
        np.testing.assert_array_equal(planned.initial[layer], ranking[layer, :c])
    with pytest.raises(ValueError, match="no .L, C. initial array"):
        planned.initial_array()
    # no pins: the Policy the core runs is the config's
    assert build_layout(ranking, 0.5, {"rule": "first_choice"}, 4).policy(
        {"rule": "first_choice"}
    ) == Policy(rule="first_choice")
    cases = [
        ({"pin": "C-2"}, None, r"layer 0 at size f0.5: pin 'C-2' pins 6 of C_l=8 slots"),
        ({"allocation": "planned"}, None, "needs the planned per-layer capacities"),
        ({}, [8, 8, 8], "a uniform one takes none"),
        ({"allocation": "planned"}, [8, 8, 9], r"summing to L x C = 3 x 8 = 24"),
        ({"allocation": "planned"}, [2, 11, 11], r"layer 0 gets C_l=2, outside \[k=4"),
        ({"allocation": "sometimes"}, None, "allocation: 'sometimes'"),
    ]
    for spec, allocation, match in cases:
        with pytest.raises(ValueError, match=match):
            build_layout(ranking, 0.5, {"rule": "fetch_all", **spec}, 4, allocation)
    with pytest.raises(ValueError, match="each expert 0..E-1 once"):
        build_layout(np.zeros((3, 16), np.int32), 0.5, {"rule": "fetch_all"}, 4)


# --------------------------------------------------------------------------------------------
# planned allocation


def _brute_split(hits: np.ndarray, caps: range, total: int, target: int):
    """Every split by enumeration: the most hits, then the least deviation from uniform."""
    best = None
    for split in itertools.product(caps, repeat=hits.shape[1]):
        if sum(split) != total:
            continue
        score = sum(hits[c - caps.start, layer] for layer, c in enumerate(split))
        key = (score, -sum(abs(c - target) for c in split))
        if best is None or key > best[0]:
            best = (key, split)
    return best[1], best[0][0]


@pytest.mark.parametrize("seed", range(6))
def test_best_split_is_the_brute_force_optimum(seed):
    """Curves that are not concave (a greedy split on marginal gains would miss the optimum)
    and ties: the DP's split has the brute force's total hits and its nearness to uniform."""
    rng = np.random.default_rng(seed)
    caps = range(2, 9)
    L, C = 3, 5
    hits = np.cumsum(rng.integers(0, 6, size=(len(caps), L)), axis=0)  # increasing, any shape
    split, total = best_split(hits, caps, L * C, C)
    want, want_total = _brute_split(hits, caps, L * C, C)
    assert sum(split) == L * C and all(c in caps for c in split)
    assert total == want_total == sum(hits[c - 2, layer] for layer, c in enumerate(split))
    assert sum(abs(c - C) for c in split) == sum(abs(c - C) for c in want)
    # flat curves: every split ties, the uniform one is kept
    assert best_split(np.zeros((len(caps), L), np.int64), caps, L * C, C) == ((5, 5, 5), 0)


def test_greedy_would_miss_a_convex_curve():
    """A layer whose hits jump only at its largest capacity: the marginal gains at each step
    favour the other layer, the exact split does not."""
    caps = range(1, 5)
    hits = np.array([[0, 0], [0, 1], [0, 2], [10, 3]])  # (capacity 1..4, layer)
    assert not is_concave(hits[:, 0]) and is_concave(hits[:, 1])
    assert best_split(hits, caps, 5, 2) == ((4, 1), 10)


def _write_calibration(path, logits, k):
    meta = {"num_experts": logits.shape[-1], "top_k": k, "num_layers": logits.shape[1],
            "norm_topk_prob": True}  # fmt: skip
    with router_writer(path, logits.shape[-1], meta, lookahead=False) as w:
        w.write_table(router_rows(0, logits))


@pytest.mark.parametrize("pin", [0, "C-k"])
def test_run_allocation_plans_on_the_calibration_capture(tmp_path, pin):
    """Layer 0 routes over 4 experts, layer 1 over 12: the plan moves slots to layer 1, keeps
    the total, maximizes the calibration hits (the curves' best split, brute-forced here) and
    never does worse than uniform there; pins resolve at each layer's planned C_l."""
    rng = np.random.default_rng(3)
    T, E, k = 400, 16, 2
    z = rng.normal(size=(T, 2, E)).astype(np.float32)
    z[:, 0, 4:] -= 8.0  # layer 0: experts 0..3 only
    z[:, 1, 12:] -= 8.0  # layer 1: experts 0..11
    _write_calibration(tmp_path / "calib.parquet", z, k)
    write_ranking(tmp_path / "ranking.parquet", np.tile(np.arange(E), (2, 1)), E)
    policy = {"rule": "fetch_all", "eviction": "lru", "pin": pin, "allocation": "planned"}
    out = tmp_path / "alloc.json"
    run_allocation(tmp_path / "calib.parquet", tmp_path / "ranking.parquet", "p", policy, 0.375,
                   out)  # fmt: skip
    doc = json.loads(out.read_text())
    C = 6
    assert doc["capacity"] == C and sum(doc["capacities"]) == 2 * C
    assert (
        doc["curves"]["capacity"] == list(capacity_range(policy, k, E, 2, C)) == list(range(2, 11))
    )
    hits = np.array(doc["curves"]["hits"])
    want, want_hits = _brute_split(hits, range(2, 11), 2 * C, C)
    assert tuple(doc["capacities"]) == want and doc["planned_hits"] == want_hits
    assert doc["capacities"][1] > doc["capacities"][0]
    assert doc["planned_hits"] >= doc["uniform_hits"] == hits[C - 2].sum()
    assert doc["pins"] == [pin_count(pin, c, k) for c in doc["capacities"]]
    assert read_allocation(out, 2, C) == tuple(doc["capacities"])
    with pytest.raises(ValueError, match="planned for C=6"):
        read_allocation(out, 2, 7)
    with pytest.raises(ValueError, match="must be 'planned'"):
        run_allocation(tmp_path / "calib.parquet", tmp_path / "ranking.parquet", "p",
                       {"rule": "fetch_all"}, 0.375, out)  # fmt: skip
    # each curve point is the grid's pinned policy at c slots: layer 1 at c = 10 with "C-k"
    # pins its 8 hottest (experts 0..7) and keeps 2 LRU slots
    if pin == "C-k":
        one = scan(z[:, [1]], k, 10, Policy(pin=8), initial=np.arange(10)[None])
        assert hits[10 - 2, 1] == (one.status == 0).sum()


def test_models_table_says_how_each_budget_was_priced():
    """The analysis' models table (shown in the report) lists each size's label and how a
    budget became slots: bits, bytes per expert and the pricing geometry (here the reference)."""
    from moesub.stats.load import DATA_KINDS, FileInfo, model_row

    budget = resolve_size("10GiB", 512, REFERENCE_GEOMETRY, 4.5)
    infos = {kind: [] for kind in DATA_KINDS}
    infos["simulate"] = [
        FileInfo("a", "simulate", 1, {"capacity": 126, "size": budget.to_dict()}, "p", 126 / 512),
        FileInfo("b", "simulate", 1, {"capacity": 128}, "p", 0.25),  # written before sizes
    ]
    row = model_row("m", [], infos)
    assert row["sizes"] == ["b10GiB", "f0.25"] and row["capacities"] == [126, 128]
    assert row["pricing"] == (
        "b10GiB: 10GiB at 4.5 bits per weight = 1769472 B per expert -> C = 126 per layer, "
        "priced at the reference geometry Qwen3-Next-80B-A3B (48 MoE layers, 512 experts, "
        "hidden 2048, expert width 512)"
    )


def test_simulate_stage_runs_the_planned_pinned_layout(tmp_path):
    """The simulate stage replays a planned, pinned layout: each layer's row is one scan of
    that layer at its C_l from its ranking prefix with its pins, and the metadata records the
    size and the layout; a budget size reaches it resolved (label, C, pricing)."""
    rng = np.random.default_rng(5)
    T, E, k = 300, 16, 2
    z = rng.normal(size=(T, 3, E)).astype(np.float32)
    _write_calibration(tmp_path / "eval.parquet", z, k)
    ranking = np.stack([rng.permutation(E) for _ in range(3)])
    write_ranking(tmp_path / "ranking.parquet", ranking, E)
    (tmp_path / "alloc.json").write_text(json.dumps({"capacity": 6, "capacities": [4, 9, 5]}))
    policy = {"rule": "fetch_all", "eviction": "lru", "pin": "C-k", "allocation": "planned"}
    size = CacheSize("b1MiB", 6, 6 / E, {"budget": "1MiB"}).to_dict()  # as the workflow passes
    out, counts_out = tmp_path / "sim.parquet", tmp_path / "sim.counts.parquet"
    run_simulate(str(tmp_path / "eval.parquet"), str(tmp_path / "ranking.parquet"), "p", policy,
                 size, str(out), str(counts_out),
                 allocation_path=str(tmp_path / "alloc.json"))  # fmt: skip
    df = pl.read_parquet(out).sort("layer")
    counts = np.concatenate(stream_counts(pl.read_parquet(counts_out)))  # (T, L, F)
    for layer, c in enumerate([4, 9, 5]):
        one = scan(z[:, [layer]], k, c, Policy(pin=c - k), initial=ranking[None, layer, :c])
        row = df.filter(pl.col("layer") == layer).row(0, named=True)
        assert row["capacity"] == c and row["hit"] == (one.status == 0).sum()
        np.testing.assert_array_equal(counts[:, layer, 0], (one.status[:, 0] == 0).sum(1))
    meta = read_metadata(out)
    assert meta["size"]["label"] == "b1MiB" and meta["layout"]["pins"] == [2, 7, 3]
    assert meta["fraction"] == 6 / E and meta["capacity"] == 6
