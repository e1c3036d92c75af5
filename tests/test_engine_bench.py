"""The real-size benchmark's parts that need no timing: the cost model's terms on constructed
counters, its fit to per-token engine timings, the captured-trace mapping onto the benchmark's
shape, and the expert kernel's choice by token count. (The 10% agreement of the fitted model
with the engine is a benchmark figure, `results/engine_bench/{device}.parquet`, not tested.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moesub.artefacts import router_rows, router_writer
from moesub.cost import CostModel
from moesub.engine.bench_inputs import bench_logits, map_trace
from moesub.engine.calibrate import TokenCounts, cost_from_fit, fit_token_costs
from moesub.engine.kernels import GROUPED_MIN_TOKENS, expert_forward, path_for

COST = dict(
    link_bandwidth_Bps=1e9, transfer_latency_s=1e-3, expert_bytes=1e6, expert_compute_s=1e-4,
    host_expert_compute_s=1e-2, dense_layer_s=1e-3, token_overhead_s=5e-4,
    background_overlap=0.25, install_s=2e-4,
)  # fmt: skip
COUNTS = dict(tokens=20, hit=30, fetch=5, sub=4, host=1, forced=0, admissions=2)


def test_cost_model_terms():
    cost = CostModel(**COST)
    # 10 tokens over 2 layers, per token: overhead 5e-4; dense 2 x 1e-3; 39 fast-tier experts
    # x 1e-4; 1 host expert x 1e-2 / 10; 5 copies x (1e-3 + 1e-3) / 10; 2 background copies x
    # (install 2e-4 + 0.75 x 1e-3 of link) / 10
    expected = 5e-4 + 2e-3 + 3.9e-4 + 1e-3 + 1e-3 + 2 * (2e-4 + 0.75e-3) / 10
    assert cost.time_per_token(COUNTS, 2) == pytest.approx(expected)
    # a prefetch is a background copy like an admission
    assert cost.time_per_token({**COUNTS, "prefetches": 3}, 2) == pytest.approx(
        expected + 3 * (2e-4 + 0.75e-3) / 10
    )
    hidden = CostModel(**{**COST, "background_overlap": 1.0})
    assert cost.time_per_token(COUNTS, 2) - hidden.time_per_token(COUNTS, 2) == pytest.approx(
        2 * 0.75e-3 / 10
    )
    with pytest.raises(ValueError, match="background_overlap"):
        CostModel(background_overlap=1.5)
    with pytest.raises(ValueError, match="dense_layer_s"):
        CostModel(dense_layer_s=-1.0)


def test_cost_model_reads_legacy_calibration(tmp_path):
    p = tmp_path / "cost.json"
    p.write_text(json.dumps({"link_bandwidth_Bps": 5e9, "background_shares_link": True}))
    assert CostModel.from_json(p).background_overlap == 0.0
    p.write_text(json.dumps({"background_shares_link": False}))
    assert CostModel.from_json(p).background_overlap == 1.0
    p.write_text(json.dumps({"link_bandwith": 5e9}))
    with pytest.raises(ValueError, match="unknown cost-model key.*link_bandwith"):
        CostModel.from_json(p)


def _tokens(n: int, rng, coef, spikes: int = 0) -> TokenCounts:
    sync = rng.poisson(1.5, n)
    host = rng.poisson(0.5, n) * (rng.random(n) < 0.5)
    bg = rng.poisson(0.3, n)
    wall = coef[0] + coef[1] * sync + coef[2] * host + coef[3] * bg + rng.normal(0, 1e-5, n)
    wall[rng.choice(n, spikes, replace=False)] += 0.5  # another process took the CPU
    return TokenCounts(wall, sync, host, bg)


def test_fit_recovers_the_terms_and_drops_outliers():
    rng = np.random.default_rng(0)
    coef = (0.02, 7e-3, 4e-3, 1e-3)
    tokens = TokenCounts.concat([_tokens(400, rng, coef, spikes=8), _tokens(300, rng, coef)])
    fit = fit_token_costs(tokens)
    got = [fit[t] for t in ("constant", "sync_copies", "host", "background")]
    np.testing.assert_allclose(got, coef, rtol=0.02, atol=2e-5)
    assert fit["kept"] == 700 - 8
    # a counter that never moves is fitted as 0, not as noise
    none = TokenCounts(tokens.wall_s, tokens.sync_copies, tokens.host, 0 * tokens.background)
    assert fit_token_costs(none)["background"] == 0.0
    with pytest.raises(ValueError, match="timed tokens"):
        fit_token_costs(TokenCounts(*(np.zeros(2) for _ in range(4))))


def test_cost_from_fit_reproduces_the_fit():
    fit = {"constant": 0.03, "sync_copies": 7e-3, "host": 4e-3, "background": 1e-3}
    kw = dict(layers=2, k=10, expert_bytes=6e6, expert_compute_s=6e-4, transfer_latency_s=1e-4,
              install_s=4e-4, dense_floor_s=1e-4)  # fmt: skip
    cost = CostModel(**cost_from_fit(fit, one_layer_s=0.016, **kw))
    # the per-layer part is 0.014 s, the per-token part 0.002 s
    assert cost.token_overhead_s == pytest.approx(0.002)
    assert cost.dense_layer_s == pytest.approx(0.014 - 10 * 6e-4)
    assert cost.copy_s == pytest.approx(7e-3)
    assert cost.host_expert_compute_s == pytest.approx(4e-3 + 6e-4)
    assert cost.background_copy_s == pytest.approx(1e-3)
    assert 0 < cost.background_overlap < 1
    # 10 tokens x 2 layers x k=10 experts: every expert hit, fetched, substituted or on the host
    for fetch, host, bg in ((5, 1, 2), (0, 0, 0), (12, 7, 3)):
        counts = dict(tokens=20, fetch=fetch, sub=4, host=host, forced=1, admissions=bg)
        counts["hit"] = 200 - fetch - 4 - host - 1
        want = 0.03 + (7e-3 * (fetch + 1) + 4e-3 * host + 1e-3 * bg) / 10
        assert cost.time_per_token(counts, 2) == pytest.approx(want)
    # the microbenchmarked expert is lowered when it would leave a layer less than the floor
    low = cost_from_fit(fit, one_layer_s=None, **{**kw, "expert_compute_s": 1e-2})
    assert low["dense_layer_s"] == pytest.approx(1e-4) and low["token_overhead_s"] == 0.0
    with pytest.raises(ValueError, match="latency"):
        cost_from_fit({**fit, "sync_copies": 5e-5}, one_layer_s=None, **kw)


def test_map_trace_layers_and_experts():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 3, 8)).astype(np.float32)
    same = map_trace(z, 3, 8)
    np.testing.assert_array_equal(same, z)
    m = map_trace(z, 5, 3)  # layers 0 1 2 0 1; experts e <- max(z[e], z[e + 3], z[e + 6])
    assert m.shape == (5, 5, 3) and m.dtype == np.float32
    for layer, src in enumerate([0, 1, 2, 0, 1]):
        for e in range(3):
            want = z[:, src, [i for i in range(8) if i % 3 == e]].max(axis=1)
            np.testing.assert_array_equal(m[:, layer, e], want)
    assert np.isfinite(m).all()
    with pytest.raises(ValueError, match="never be routed"):
        map_trace(z, 2, 9)


def _write(path, streams):
    E, L = streams[0].shape[2], streams[0].shape[1]
    meta = {"num_experts": E, "top_k": 2, "num_layers": L, "norm_topk_prob": True}
    with router_writer(path, E, meta, lookahead=False) as w:
        for i, z in enumerate(streams):
            w.write_table(router_rows(i, z))


def test_bench_logits_from_a_capture(tmp_path):
    rng = np.random.default_rng(1)
    calib = [rng.normal(size=(6, 2, 8)).astype(np.float32) for _ in range(2)]
    evals = [rng.normal(size=(7, 2, 8)).astype(np.float32) for _ in range(3)]
    _write(tmp_path / "calib_router.parquet", calib)
    _write(tmp_path / "eval_router.parquet", evals)
    b = bench_logits("trace", 3, 4, 10, 9, 8, 0, tmp_path)
    cat_c, cat_e = np.concatenate(calib), np.concatenate(evals)  # streams in order
    np.testing.assert_array_equal(b.initial, map_trace(cat_c[:10], 3, 4))
    np.testing.assert_array_equal(b.validation, map_trace(cat_e[:9], 3, 4))
    np.testing.assert_array_equal(b.calibration, map_trace(cat_e[9:17], 3, 4))
    with pytest.raises(ValueError, match="evaluation tokens"):
        bench_logits("trace", 3, 4, 10, 15, 8, 0, tmp_path)
    with pytest.raises(FileNotFoundError, match="calib_router"):
        bench_logits("trace", 3, 4, 10, 9, 8, 0, tmp_path / "nowhere")
    s = bench_logits("synthetic", 2, 8, 10, 9, 8, 0)
    assert (s.initial.shape, s.validation.shape, s.calibration.shape) == (
        (10, 2, 8), (9, 2, 8), (8, 2, 8),
    )  # fmt: skip
    with pytest.raises(ValueError, match="routing"):
        bench_logits("replay", 2, 8, 10, 9, 8, 0)


def test_kernel_path_by_token_count():
    assert path_for("grouped", 1) == "per_expert"
    assert path_for("grouped", GROUPED_MIN_TOKENS) == "grouped"
    assert path_for("per_expert", 1000) == "per_expert"
    with pytest.raises(ValueError, match="expert kernel path"):
        path_for("gathered", 1)


@pytest.mark.parametrize("N", [1, 5])
def test_per_expert_kernel_matches_the_reference(N):
    g = torch.Generator().manual_seed(0)
    G, H, I, k = 6, 16, 8, 3
    gate_up, down = torch.randn(G, 2 * I, H, generator=g), torch.randn(G, H, I, generator=g)
    x, w = torch.randn(N, H, generator=g), torch.rand(N, k, generator=g)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(G, size=k, replace=False) for _ in range(N)])
    ids[0, 1] = -1  # skipped
    want = torch.zeros(N, H)
    for n in range(N):
        for j in range(k):
            if ids[n, j] >= 0:
                gate, up = (gate_up[ids[n, j]] @ x[n]).chunk(2)
                want[n] += w[n, j] * (down[ids[n, j]] @ (F.silu(gate) * up))
    got = expert_forward(x, ids, w, gate_up, down, F.silu, "per_expert")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
