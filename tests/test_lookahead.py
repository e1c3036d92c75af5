"""Lookahead logits (policy v2 prefetch): capture records them exactly for every family, the
trace stores them beside the router logits, and old traces without them still load."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import transformers as tf
from tiny_models import tiny_qwen3_next

from moesub.artefacts import has_lookahead, load_trace, router_rows, router_writer
from moesub.capture import capture_batch
from moesub.models import RouterHook, moe_blocks, moe_info

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 53
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
COMMON.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)


def family_model(family: str) -> torch.nn.Module:
    """Tiny random models with >= 2 MoE layers and, where the family allows, a dense layer
    before and between them (so MoE layer indices differ from decoder-layer indices)."""
    torch.manual_seed(1)
    if family == "qwen3_next":  # the embedded model's shape: dense first layer
        return tiny_qwen3_next(
            vocab=VOCAB,
            layers=4,
            experts=12,
            k=3,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
        ).eval()
    if family == "qwen3_moe":  # MoE at decoder layers 1 and 3
        cfg = tf.Qwen3MoeConfig(
            **COMMON, intermediate_size=48, num_hidden_layers=4, head_dim=16, num_experts=12,
            num_experts_per_tok=3, moe_intermediate_size=8, decoder_sparse_step=2,
        )  # fmt: skip
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(
            **COMMON, intermediate_size=8, num_hidden_layers=3, num_experts=12,
            num_experts_per_tok=3,
        )  # fmt: skip
    elif family == "flex_olmo":  # no pre-MoE norm (post-norm layers)
        cfg = tf.FlexOlmoConfig(
            **COMMON, intermediate_size=8, num_hidden_layers=3, num_experts=8,
            num_experts_per_tok=2,
        )  # fmt: skip
    else:
        raise KeyError(family)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    for block in moe_blocks(model):
        torch.nn.init.normal_(block.gate.weight, std=0.5)
    return model


class _Zero(torch.nn.Module):
    def forward(self, x, *args, **kwargs):
        return torch.zeros_like(x)


@torch.inference_mode()
def independent_lookahead(model, ids: torch.Tensor) -> np.ndarray:
    """(B, T, L, E) lookahead logits from plain forwards, no hook: the residual stream entering
    MoE layer m's MoE sub-block is the output of its decoder layer when its MLP adds zero
    (x + 0 == x; the layers before it are unchanged), read with output_hidden_states; the one
    entering MoE layer 0's decoder layer is that layer's input."""
    info = moe_info(model)
    layers = model.model.layers
    idx = info.layer_indices

    def hidden(zero_mlp_at: int | None) -> tuple[torch.Tensor, ...]:
        if zero_mlp_at is None:
            return model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        layer = layers[zero_mlp_at]
        mlp, layer.mlp = layer.mlp, _Zero()
        try:
            return model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        finally:
            layer.mlp = mlp

    sources = [hidden(None)[idx[0]]]  # input of MoE layer 0's decoder layer
    sources += [hidden(idx[m])[idx[m] + 1] for m in range(info.num_layers - 1)]
    out = []
    for layer, src in zip(idx, sources, strict=True):
        dec = layers[layer]
        x = src if info.family == "flex_olmo" else dec.post_attention_layernorm(src)
        y = dec.mlp.gate(x.reshape(-1, x.shape[-1]))[0].float()
        out.append(y.reshape(*ids.shape, -1))
    return torch.stack(out, dim=2).numpy()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_moe", "olmoe", "flex_olmo"])
def test_capture_records_lookahead_exactly(family, tmp_path):
    model = family_model(family)
    info = moe_info(model)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (2, 9))
    path = tmp_path / "router.parquet"
    meta = {"num_experts": info.num_experts, "top_k": info.top_k, "num_layers": info.num_layers}
    meta["norm_topk_prob"] = info.norm_topk_prob
    with router_writer(path, info.num_experts, meta) as w:
        capture_batch(model, w, [4, 9], ids, rows_per_group=4)
    trace = load_trace(path, lookahead=True)
    want = independent_lookahead(model, torch.from_numpy(ids))
    assert trace.streams == [4, 9]
    for b in range(2):
        np.testing.assert_array_equal(trace.lookahead[b], want[b])
    # layer 0's lookahead is not its router logits; hook-free router logits still match
    assert not np.array_equal(trace.lookahead[0][:, 0], trace.logits[0][:, 0])
    with torch.inference_mode():
        out = model(input_ids=torch.from_numpy(ids), use_cache=False, output_router_logits=True)
    ref = torch.stack([z.float() for z in out.router_logits], dim=1).numpy()  # (B*T, L, E)
    np.testing.assert_array_equal(np.concatenate(trace.logits), ref)


def test_lookahead_hook_leaves_the_forward_unchanged():
    model = family_model("qwen3_next")
    ids = torch.from_numpy(np.random.default_rng(2).integers(3, VOCAB, (1, 11)))
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=False).logits
        seen = []
        with RouterHook(model, lambda l, z, w, i, y: seen.append(l), lookahead=True):
            hooked = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(plain, hooked)
    assert seen == list(range(moe_info(model).num_layers))  # the inner router calls are silent


def test_old_trace_loads_for_v1_and_names_the_missing_lookahead(tmp_path):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((5, 2, 8)).astype(np.float32)
    meta = {"num_experts": 8, "top_k": 2, "num_layers": 2, "norm_topk_prob": True}
    old = tmp_path / "old.parquet"
    with router_writer(old, 8, meta, lookahead=False) as w:
        w.write_table(router_rows(0, z))
    assert not has_lookahead(old)
    np.testing.assert_array_equal(load_trace(old).logits[0], z)
    assert load_trace(old).lookahead is None
    with pytest.raises(ValueError, match="no lookahead logits.*prefetch"):
        load_trace(old, lookahead=True)
    new = tmp_path / "new.parquet"
    y = rng.standard_normal(z.shape).astype(np.float32)
    with router_writer(new, 8, meta) as w:  # rows in reverse order: sorted back together
        w.write_table(router_rows(0, z[3:], 3, y[3:]))
        w.write_table(router_rows(0, z[:3], 0, y[:3]))
    assert has_lookahead(new) and pq.read_schema(new).names[-1] == "lookahead"
    t = load_trace(new, lookahead=True)
    np.testing.assert_array_equal(t.logits[0], z)
    np.testing.assert_array_equal(t.lookahead[0], y)
    with pytest.raises(ValueError, match="lookahead has shape"):
        router_rows(0, z, 0, y[:, :1])


def test_lookahead_recall_by_hand_and_in_the_regime_table(tmp_path):
    from moesub.regime import lookahead_recall, measure_regime, regime_from_files

    # one layer, E=6, k=2: the top-2 of z are {0, 1} and {2, 3}
    z = np.array([[[5, 4, 1, 0, 0, 0]], [[0, 0, 5, 4, 1, 1]]], np.float32)  # (T=2, L=1, E)
    y = np.array([[[2, 3, 2.5, 0, 0, 0]], [[0, 0, 1, 1, 0, 0]]], np.float32)
    found, total = lookahead_recall([z], [y], 2, 2)
    assert found.tolist() == [1 + 2] and total.tolist() == [4]  # {1,2} & {0,1}; {2,3} & {2,3}
    found, _ = lookahead_recall([z], [y], 2, 1)
    assert found.tolist() == [1 + 1]  # {1} & {0,1}; the tie 2 vs 3 goes to 2: {2} & {2,3}
    with pytest.raises(ValueError, match="n: must be in"):
        lookahead_recall([z], [y], 2, 7)
    rng = np.random.default_rng(0)
    streams = [rng.standard_normal((30, 2, 8)).astype(np.float32) for _ in range(2)]
    same = measure_regime(streams, 2, 4, None, lookahead=streams)  # a perfect predictor
    assert (same.layers["lookahead_recall_k"] == 1.0).all()
    assert same.summary["lookahead_recall_2k"] == 1.0
    none = measure_regime(streams, 2, 4, None)
    assert none.layers["lookahead_recall_k"].null_count() == none.layers.height
    meta = {"num_experts": 8, "top_k": 2, "num_layers": 2, "norm_topk_prob": True}
    noisy = [z + rng.standard_normal(z.shape).astype(np.float32) for z in streams]
    with router_writer(tmp_path / "r.parquet", 8, meta) as w:
        for s, (z, y) in enumerate(zip(streams, noisy, strict=True)):
            w.write_table(router_rows(s, z, 0, y))
    table = regime_from_files(tmp_path / "r.parquet", None, 0.5).layers
    want = [lookahead_recall(streams, noisy, 2, n) for n in (2, 4)]
    for col, (found, total) in zip(
        ("lookahead_recall_k", "lookahead_recall_2k"), want, strict=True
    ):
        rows = table.sort("layer")  # -1 first: all layers pooled
        assert rows[col].to_list() == [found.sum() / total.sum(), *(found / total).tolist()]
    assert 0 < table["lookahead_recall_k"].min() < table["lookahead_recall_2k"].max() < 1


def test_a_trace_with_float32_list_logits_still_loads(tmp_path):
    """Traces captured before the binary logit column stored fixed_size_list<float32>[E]."""
    import pyarrow as pa

    z = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    t = router_rows(0, z).drop_columns(["logits"])
    lists = pa.FixedSizeListArray.from_arrays(pa.array(z.reshape(-1)), 4)
    t = t.append_column("logits", lists).replace_schema_metadata(
        {b"num_experts": b"4", b"top_k": b"1", b"num_layers": b"2", b"norm_topk_prob": b"true"}
    )
    pq.write_table(t, tmp_path / "lists.parquet")
    np.testing.assert_array_equal(load_trace(tmp_path / "lists.parquet").logits[0], z)
