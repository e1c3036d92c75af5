"""Emulation of the policy v2 fields (docs/policy-semantics.md, v2) on a tiny random Qwen3-Next
(E=16, k=4, C=6, a dense first layer): prefetch from lookahead logits recomputed from the
emulated hidden states, route_bias, light_miss='host', substitute_by='coactivation'; belady is
offline-only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_qwen3_next

from moesub.artefacts import load_trace, router_writer
from moesub.capture import capture_batch
from moesub.coactivation import coactivation
from moesub.emulate import emulate_batch, emulate_stream, emulate_token_by_token
from moesub.models import RouterHook, moe_blocks, moe_info, router_weights, stream_nll
from moesub.policy import HOST, SUB, Policy, scan
from moesub.replay import make_caches, policy_router

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB, E, K, C = 97, 16, 4, 6
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


@pytest.fixture(scope="module")
def model():
    m = tiny_qwen3_next(
        vocab=VOCAB, layers=4, experts=E, k=K, expert_std=0.4, layer_types=LAYER_TYPES, seed=0
    )
    assert moe_info(m).layer_indices == (0, 1, 2, 3)
    return m


@pytest.fixture(scope="module")
def streams():
    return np.random.default_rng(3).integers(3, VOCAB, (2, 48))


@pytest.fixture(scope="module")
def initial():
    rng = np.random.default_rng(1)
    return np.stack([rng.permutation(E)[:C] for _ in range(4)]).astype(np.int32)


@pytest.fixture(scope="module")
def captured(model, streams, tmp_path_factory):
    """The exact capture of `streams` (one forward), loaded back with the lookahead."""
    path = tmp_path_factory.mktemp("cap") / "router.parquet"
    meta = {"num_experts": E, "top_k": K, "num_layers": 4, "norm_topk_prob": True}
    with router_writer(path, E, meta) as w:
        nll = capture_batch(model, w, [0, 1], streams, rows_per_group=16)
    return nll, load_trace(path, lookahead=True)


@pytest.fixture(scope="module")
def table(captured):
    return coactivation(captured[1].logits, K)


LOSSLESS = {
    "prefetch_2": Policy(prefetch=2),
    "prefetch_c": Policy(prefetch=C, eviction="lfu"),
    "host_light": Policy(rule="threshold", tau=0.3, light_miss="host", prefetch=3),
    "first_host": Policy(rule="first_choice", eviction="lfu", light_miss="host"),
    "coact_fetch": Policy(substitute_by="coactivation", prefetch=1),
}


@pytest.mark.parametrize("name", list(LOSSLESS))
def test_lossless_v2_policies_reproduce_the_captured_nll_bit_for_bit(
    name, model, streams, initial, captured, table
):
    nll, trace = captured
    out = emulate_batch(model, streams, LOSSLESS[name], C, initial, record=True, coactivation=table)
    for b, got in enumerate(out):
        assert np.array_equal(got.nll, nll[b], equal_nan=True)
        assert (got.mass == 0).all() and not (got.status == SUB).any()
        # lookahead recomputed from the replayed (here: exact) hidden states = the captured one
        if got.lookahead is not None:
            np.testing.assert_array_equal(got.lookahead, trace.lookahead[b])
    if name == "host_light":
        assert sum((t.status == HOST).sum() for t in out) > 0
    if LOSSLESS[name].prefetch:
        assert sum(t.prefetched.sum() for t in out) > 0


SUBSTITUTING = {
    "prefetch_quality": Policy(rule="threshold", tau=0.15, eviction="lfu", beta=0.5, prefetch=2),
    "cache_prior": Policy(rule="threshold", tau=0.15, route_bias=0.1),
    "biased_prefetch": Policy(rule="first_choice", eviction="lfu", route_bias=0.05, prefetch=3),
    "buddy": Policy(rule="threshold", tau=0.15, substitute_by="coactivation", prefetch=1),
}


@pytest.mark.parametrize("name", list(SUBSTITUTING))
def test_emulated_decisions_equal_the_core_on_the_emulated_inputs(
    name, model, streams, initial, captured, table
):
    """The core's `scan` over the router and lookahead logits the emulation saw makes the
    emulation's decisions; the captured lookahead would not (substitution changes it)."""
    pol = SUBSTITUTING[name]
    got = emulate_stream(model, streams[0], pol, C, initial, record=True, coactivation=table)
    ref = scan(got.logits, K, C, pol, initial, coactivation=table, lookahead=got.lookahead)
    for field in ("ids", "status", "selected", "prefetched"):
        np.testing.assert_array_equal(getattr(got, field), getattr(ref, field), err_msg=field)
    np.testing.assert_allclose(got.mass, ref.mass, rtol=0, atol=1e-12)
    assert (got.status == SUB).sum() > 5
    _, trace = captured
    assert not np.array_equal(got.logits[:, 1:], trace.logits[0][:, 1:])
    if pol.prefetch:
        assert got.prefetched.sum() > 0
        assert not np.array_equal(got.lookahead[:, 1:], trace.lookahead[0][:, 1:])
    if pol.route_bias:
        topk = np.argsort(-got.logits, axis=-1, kind="stable")[..., :K]
        rerouted = (np.sort(topk, -1) != np.sort(got.selected, -1)).any(-1)
        assert rerouted.sum() > 5  # some rows compute the core's selection, not the router's


@pytest.mark.parametrize("name", ["biased_prefetch", "buddy"])
def test_layer_major_equals_token_by_token_for_v2(name, model, streams, initial, table):
    pol = SUBSTITUTING[name]
    fast = emulate_stream(model, streams[1], pol, C, initial, record=True, coactivation=table)
    slow = emulate_token_by_token(model, streams[1], pol, C, initial, coactivation=table)
    for field in ("selected", "status", "ids", "prefetched"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field), err_msg=field)
    np.testing.assert_allclose(fast.nll, slow.nll, atol=1e-5, equal_nan=True)


def test_rerouted_rows_use_the_gate_weights_of_the_core_selection(model, streams, initial):
    """route_bias: a rerouted row computes S with the router's weights for S, which for a
    renormalizing gate are the core's weights (float32 vs float64)."""
    pol = SUBSTITUTING["cache_prior"]
    router = policy_router(model, pol, C, initial, record=True)
    applied = []
    block = moe_blocks(model)[2]
    handle = block.experts.register_forward_pre_hook(
        lambda m, args: applied.append((args[1].clone(), args[2].clone()))
    )
    try:
        with RouterHook(model, router), torch.inference_mode():
            stream_nll(model, torch.as_tensor(streams[:1]))
    finally:
        handle.remove()
    got = router.take(np.zeros(streams.shape[1]))
    ids, weights = applied[0]  # the experts' (ids [T, k], weights [T, k]) at MoE layer 2
    ref = scan(got.logits, K, C, pol, initial)
    own = np.argsort(-got.logits[:, 2], axis=-1, kind="stable")[:, :K]
    assert (np.sort(own, -1) != np.sort(got.selected[:, 2], -1)).any(-1).sum() > 2  # rerouted
    # slots follow the model's order where S is the router's own set, S's rank order elsewhere
    model_order = np.argsort(ids.numpy(), axis=1)
    core_order = np.argsort(got.ids[:, 2], axis=1)
    take = np.take_along_axis
    np.testing.assert_array_equal(
        take(ids.numpy(), model_order, 1), take(got.ids[:, 2], core_order, 1)
    )
    np.testing.assert_allclose(
        take(weights.numpy(), model_order, 1), take(ref.weights[:, 2], core_order, 1), atol=1e-6
    )
    with torch.inference_mode():  # the router's own top-k: its weights bit for bit
        logits, w_model, i_model = block.gate(torch.randn(40, 32))
    assert torch.equal(router_weights(logits, i_model, True), w_model)


def test_belady_and_a_missing_coactivation_table_are_named_errors(model, streams, initial):
    with pytest.raises(ValueError, match="offline-only"):
        emulate_stream(model, streams[0], Policy(eviction="belady"), C, initial)
    with pytest.raises(ValueError, match="coactivation.*co-activation table"):
        make_caches(model, Policy(substitute_by="coactivation"), C, initial)
    with pytest.raises(ValueError, match="coactivation: expected"):
        make_caches(model, Policy(substitute_by="coactivation"), C, initial, np.zeros((3, E, E)))


def test_run_emulate_checks_the_v2_inputs_before_loading_the_model(tmp_path):
    from moesub.emulate import run_emulate

    for name in ("model", "tokens.parquet", "init.parquet"):
        (tmp_path / name).touch()  # never read: every check below comes first
    args = (tmp_path / "model", tmp_path / "tokens.parquet", tmp_path / "init.parquet", "p")
    out = tmp_path / "out.parquet"
    with pytest.raises(ValueError, match="belady.*offline-only"):
        run_emulate(*args, {"eviction": "belady"}, 0.25, out)
    with pytest.raises(ValueError, match="coactivation_path"):
        run_emulate(*args, {"rule": "substitute_all", "substitute_by": "coactivation"}, 0.25, out)
    with pytest.raises(FileNotFoundError, match="coactivation_path"):
        run_emulate(
            *args, {"substitute_by": "coactivation"}, 0.25, out, None, tmp_path / "none.npz"
        )
    assert not out.exists()


def test_greedy_decode_under_v2_matches_teacher_forced_emulation(model, initial, table):
    """Decoding with the KV cache: the lookahead of each step's new rows comes from that step's
    forward, and the decisions are the teacher-forced emulation's over the same tokens."""
    from moesub.greedy import greedy_decode

    pol = SUBSTITUTING["biased_prefetch"]
    prompt = [7, 21, 50, 3, 64, 12]
    (res,) = greedy_decode(model, [prompt], pol, C, initial, 10, coactivation=table)
    seq = np.array(prompt + res.tokens)
    trace = emulate_stream(model, seq, pol, C, initial)
    rows = np.arange(len(prompt) - 1, len(seq) - 1)
    np.testing.assert_allclose(res.mass, trace.mass.sum(1)[rows], atol=1e-5)
    assert sum(res.mass) > 0
