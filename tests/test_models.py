"""moesub.models: structure per family, loading errors, router hook bit-identity, align_ids."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from moesub.models import (
    MoEFamily,
    MoEInfo,
    RouterHook,
    align_ids,
    cache_argument,
    cached_forward,
    check_checkpoint,
    families,
    load_model,
    load_tokenizer,
    moe_blocks,
    moe_family,
    moe_info,
    stream_nll,
)
from moesub.models.nll import head_rows

VOCAB = 97


def tiny_config(family: str):
    """A tiny random config per family (E, k and the MoE layer pattern are deliberately odd)."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    common.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(
            **common, intermediate_size=48, num_hidden_layers=4, head_dim=16,
            linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=24, num_experts_per_tok=5,
            moe_intermediate_size=8, shared_expert_intermediate_size=8, norm_topk_prob=True,
        )  # fmt: skip
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, intermediate_size=48, num_hidden_layers=3, head_dim=16, num_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=8, decoder_sparse_step=2,
            norm_topk_prob=False,
        )  # fmt: skip
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, intermediate_size=48, num_hidden_layers=2, num_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        )  # fmt: skip
    if family == "olmoe":
        return tf.OlmoeConfig(
            **common, intermediate_size=8, num_hidden_layers=2, num_experts=16,
            num_experts_per_tok=4,
        )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(
            **common, intermediate_size=8, num_hidden_layers=2, num_local_experts=8,
            num_experts_per_tok=2,
        )  # fmt: skip
    if family == "flex_olmo":
        return tf.FlexOlmoConfig(
            **common, intermediate_size=8, num_hidden_layers=2, num_experts=8,
            num_experts_per_tok=3,
        )  # fmt: skip
    raise KeyError(family)


FAMILIES = ["qwen3_next", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "flex_olmo"]
EXPECTED = {  # (L, layer_indices, E, k, norm, width, shared)
    "qwen3_next": (4, (0, 1, 2, 3), 24, 5, True, 8, True),
    "qwen3_moe": (1, (1,), 16, 4, False, 8, False),
    "qwen2_moe": (2, (0, 1), 16, 4, False, 8, True),
    "olmoe": (2, (0, 1), 16, 4, False, 8, False),
    "mixtral": (2, (0, 1), 8, 2, True, 8, False),
    "flex_olmo": (2, (0, 1), 8, 3, False, 8, False),
}


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    # random (not zero) router weights so that routing is non-trivial
    for block in moe_blocks(model):
        torch.nn.init.normal_(block.gate.weight, std=0.5)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


def test_moe_info_matches_structure(family_model):
    family, model = family_model
    info = moe_info(model)
    L, idx, E, k, norm, width, shared = EXPECTED[family]
    # the decoder layers' weights but the routed experts', over the MoE layers
    dense = sum(p.numel() for n, p in model.model.layers.named_parameters()
                if ".mlp.experts." not in n) / L  # fmt: skip
    assert info == MoEInfo(family, L, idx, E, k, norm, 32, width, shared, VOCAB, dense)
    blocks = moe_blocks(model)
    assert len(blocks) == L
    for i, b in zip(idx, blocks, strict=True):
        assert model.model.layers[i].mlp is b
        gate_up, down = moe_family(model).expert_weights(b)
        assert gate_up.shape == (E, 2 * width, 32) and down.shape == (E, 32, width)
        assert gate_up is b.experts.gate_up_proj  # a view of the real parameter, not a copy


class _PastKeyValuesNames(nn.Module):
    """A model as transformers before the rename takes and returns its KV cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        out = self.model(input_ids=input_ids, use_cache=use_cache, cache=past_key_values)
        return dataclasses.make_dataclass("Out", ["logits", "past_key_values"])(
            out.logits, out.cache
        )


def test_cached_forward_uses_the_cache_under_either_name(family_model):
    """Token-by-token decoding through `cached_forward` gives the full forward's logits (a cache
    passed under a name the model ignores would lose the context), under `cache` and under the
    older `past_key_values`."""
    _, model = family_model
    ids = torch.tensor([[5, 17, 42, 8, 63, 21]])
    full = _logits(model, ids)[0]  # (T, V)
    for m, name in ((model, "cache"), (_PastKeyValuesNames(model), "past_key_values")):
        assert cache_argument(type(m)) == name
        cache, rows = None, []
        with torch.inference_mode():
            for t in range(ids.shape[1]):
                out, cache = cached_forward(m, ids[:, t : t + 1], cache)
                rows.append(out.logits[0, -1])
        torch.testing.assert_close(torch.stack(rows), full, rtol=1e-4, atol=1e-4)


def test_cache_argument_names_a_forward_without_one():
    class NoCache(nn.Module):
        def forward(self, input_ids, use_cache=False):
            return input_ids

    with pytest.raises(TypeError, match=r"NoCache.forward takes none of \('cache'"):
        cache_argument(NoCache)


def _logits(model, ids, hook=None):
    with torch.inference_mode():
        if hook is None:
            return model(ids, use_cache=False).logits
        with RouterHook(model, hook):
            return model(ids, use_cache=False).logits


def _core_topk(logits: torch.Tensor, k: int) -> np.ndarray:
    """The policy core's selection: k largest logits, ties to the lower id (stable sort)."""
    return np.argsort(-logits.numpy(), axis=-1, kind="stable")[:, :k].astype(np.int32)


def test_hook_bit_identical(family_model):
    family, model = family_model
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    info = moe_info(model)
    seen = []

    def record(layer, logits, weights, sel):
        assert logits.dtype == torch.float32 and logits.shape == (2 * 13, info.num_experts)
        assert weights.shape == sel.shape == (2 * 13, info.top_k)
        seen.append(layer)
        return None

    assert torch.equal(_logits(model, ids, record), ref)
    assert seen == list(range(info.num_layers))

    def same(layer, logits, weights, sel):
        return sel.clone()

    assert torch.equal(_logits(model, ids, same), ref)

    def via_core(layer, logits, weights, sel):
        core = _core_topk(logits, info.top_k)  # rank order differs from slot order in general
        return align_ids(sel, core, core)  # "every expert resident": computed == selected

    assert torch.equal(_logits(model, ids, via_core), ref)
    # hooks are removed on exit
    assert all(not b.gate._forward_hooks for b in moe_blocks(model))


def test_hook_replacement_routes_computation():
    """Replacing ids through a permutation on a model whose experts are permuted the same way
    gives the original output: the returned ids really choose the expert that is computed."""
    model = tiny_model("qwen3_moe")
    E = moe_info(model).num_experts
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(3))
    permuted = tiny_model("qwen3_moe")
    for b in moe_blocks(permuted):
        gate_up, down = moe_family(permuted).expert_weights(b)
        with torch.no_grad():
            gate_up[perm] = gate_up.clone()
            down[perm] = down.clone()
    ids = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, ids)
    moved = _logits(permuted, ids)
    assert not torch.allclose(moved, ref, atol=1e-4)
    out = _logits(permuted, ids, lambda layer, z, w, sel: perm[sel])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_hook_bad_shape_raises():
    model = tiny_model("mixtral")
    ids = torch.zeros((1, 4), dtype=torch.long)
    with pytest.raises(ValueError, match="shape"):
        _logits(model, ids, lambda layer, z, w, sel: sel[:, :1])
    assert all(not b.gate._forward_hooks for b in moe_blocks(model))


class SplitExperts(nn.Module):
    """Experts as separate gate / up / down tensors (a layout outside today's table)."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        width = fused.down_proj.shape[-1]
        self.gate_proj = nn.Parameter(fused.gate_up_proj[:, :width].detach().clone())
        self.up_proj = nn.Parameter(fused.gate_up_proj[:, width:].detach().clone())
        self.down_proj = nn.Parameter(fused.down_proj.detach().clone())
        self.act = fused.act_fn

    def forward(self, hidden, ids, weights):  # [N, H], [N, k], [N, k] -> [N, H]
        out = torch.zeros_like(hidden)
        for n, j in np.ndindex(*ids.shape):
            e, x = int(ids[n, j]), hidden[n]
            y = self.act(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e])
            out[n] += weights[n, j] * F.linear(y, self.down_proj[e])
        return out


class IdsFirstRouter(nn.Module):
    """A TopKRouter whose output is (ids, weights, logits)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        logits, weights, ids = self.inner(x)
        return ids, weights, logits


class OtherBlock(nn.Module):
    """A sparse block of another layout: the router at `router`, split experts."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.router, self.experts = IdsFirstRouter(block.gate), SplitExperts(block.experts)

    def forward(self, hidden):
        x = hidden.reshape(-1, hidden.shape[-1])
        ids, weights, _ = self.router(x)
        return self.experts(x, ids, weights).reshape(hidden.shape)


class OtherFamily(MoEFamily):
    """The one adapter class the other layout needs."""

    def is_sparse(self, block):
        return isinstance(getattr(block, "router", None), IdsFirstRouter)

    def router(self, block):
        return block.router

    def top_k(self, block):
        return int(block.router.inner.top_k)

    def split_route(self, output):
        ids, weights, logits = output
        return logits, weights, ids

    def join_route(self, output, weights, ids):
        return ids, weights, output[2]

    def expert_weights(self, block):
        e = block.experts
        return torch.cat([e.gate_proj, e.up_proj], dim=1), e.down_proj

    def expert_act(self, block):
        return block.experts.act


def test_a_family_of_another_layout_is_one_adapter(monkeypatch):
    """A family whose router sits elsewhere and returns its values in another order, and whose
    experts are split tensors, is read by one `MoEFamily` subclass: its geometry, its experts in
    the engine's layout, and the router hook (observe, keep, reroute) work as for the stock one."""
    model = tiny_model("qwen3_moe")
    other = tiny_model("qwen3_moe")
    for layer in other.model.layers:
        if isinstance(layer.mlp, tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock):
            layer.mlp = OtherBlock(layer.mlp)
    other.config.model_type = "other_moe"
    monkeypatch.setitem(families.FAMILIES, "other_moe", OtherFamily("other_moe"))
    info = moe_info(model)
    assert moe_info(other) == dataclasses.replace(info, family="other_moe")
    for b, b_other in zip(moe_blocks(model), moe_blocks(other), strict=True):
        ref, got = moe_family(model).expert_weights(b), moe_family(other).expert_weights(b_other)
        assert all(torch.equal(r, g) for r, g in zip(ref, got, strict=True))
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(4))
    out = _logits(other, ids)
    torch.testing.assert_close(out, _logits(model, ids), rtol=1e-5, atol=1e-6)
    seen = []

    def keep(layer, logits, weights, sel):
        seen.append((layer, logits.shape, weights.shape, sel.shape))
        return sel.clone()

    assert torch.equal(_logits(other, ids, keep), out)
    assert seen == [(0, (11, info.num_experts), (11, info.top_k), (11, info.top_k))]
    perm = torch.randperm(info.num_experts, generator=torch.Generator().manual_seed(3))
    for b in moe_blocks(other):
        with torch.no_grad():
            for t in (b.experts.gate_proj, b.experts.up_proj, b.experts.down_proj):
                t[perm] = t.clone()
    rerouted = _logits(other, ids, lambda layer, z, w, sel: perm[sel])
    torch.testing.assert_close(rerouted, out, rtol=1e-5, atol=1e-6)
    assert all(not b.router._forward_hooks for b in moe_blocks(other))


def test_align_ids_maps_ranks_to_slots():
    model_ids = torch.tensor([[5, 2, 9], [1, 0, 3]])
    selected = np.array([[2, 5, 9], [0, 1, 3]])  # core rank order
    computed = np.array([[2, 7, 9], [4, 1, 3]])  # rank 1 of row 0 (expert 5) -> 7, etc.
    out = align_ids(model_ids, selected, computed)
    assert out.dtype == model_ids.dtype
    assert out.tolist() == [[7, 2, 9], [1, 4, 3]]


def test_align_ids_tie_errors_and_resolution():
    model_ids = torch.tensor([[0, 3]])
    selected = np.array([[0, 2]])  # core picked 2, model picked 3
    computed = np.array([[0, 6]])
    with pytest.raises(ValueError, match="tie"):
        align_ids(model_ids, selected, computed)
    tied = torch.tensor([[3.0, 0.0, 1.0, 1.0, -1.0, -2.0, -3.0]])
    assert align_ids(model_ids, selected, computed, logits=tied).tolist() == [[0, 6]]
    not_tied = torch.tensor([[3.0, 0.0, 1.0, 0.5, -1.0, -2.0, -3.0]])
    with pytest.raises(ValueError, match="not by an exact tie"):
        align_ids(model_ids, selected, computed, logits=not_tied)


def dense_config():
    return tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip


def test_unsupported_family_raises():
    cfg = dense_config()
    with pytest.raises(ValueError, match="not supported"):
        moe_info(tf.AutoModelForCausalLM.from_config(cfg))


@pytest.fixture(scope="module")
def saved_qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "qwen3moe"
    model = tiny_model("qwen3_moe")
    model.save_pretrained(path)
    return path, model


def test_check_checkpoint_and_load(saved_qwen3_moe):
    path, model = saved_qwen3_moe
    info = check_checkpoint(path)
    assert info == moe_info(model)
    loaded, tok = load_model(path)
    assert tok is None  # no tokenizer files saved
    assert not loaded.training
    # weights are copied out of the memory-mapped file: aligned memory, results as in-memory
    assert all(t.data_ptr() % 64 == 0 for t in loaded.parameters())
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    nll = stream_nll(loaded, ids)
    assert nll.shape == (1, 9) and nll.dtype == np.float64
    assert np.isnan(nll[0, 0]) and np.isfinite(nll[0, 1:]).all()


def test_check_checkpoint_errors(tmp_path, saved_qwen3_moe):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        check_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty.*config.json"):
        check_checkpoint(empty)
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((saved_qwen3_moe[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="noweights.*weight files"):
        check_checkpoint(no_weights)
    dense = tmp_path / "dense"
    cfg = dense_config()
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(dense)
    with pytest.raises(ValueError, match="dense.*'llama' is not a supported MoE"):
        load_model(dense)
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    (garbled / "config.json").write_text("{not json")
    (garbled / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="garbled"):
        check_checkpoint(garbled)
    no_moe = tmp_path / "nomoe"
    no_moe.mkdir()
    cfg = json.loads((saved_qwen3_moe[0] / "config.json").read_text())
    cfg["mlp_only_layers"] = [0, 1, 2]
    (no_moe / "config.json").write_text(json.dumps(cfg))
    (no_moe / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="nomoe.*no sparse MoE layer"):
        check_checkpoint(no_moe)


def test_checkpoint_file_and_tokenizer_errors(saved_qwen3_moe):
    """A path naming the weights file, and a checkpoint without tokenizer files, say so."""
    path, _ = saved_qwen3_moe
    with pytest.raises(ValueError, match=r"model.safetensors' is a file; give the checkpoint dir"):
        check_checkpoint(path / "model.safetensors")
    with pytest.raises(ValueError, match="is a file"):
        load_model(path / "model.safetensors")
    assert check_checkpoint(path).num_experts > 0  # the tokenizer is optional for the library
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer \(none of tokenizer.json"):
        check_checkpoint(path, tokenizer=True)  # the pipeline's check (rule model_checkpoint)
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_tokenizer(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_nll_matches_plain_forward(family, monkeypatch):
    """The decoder + chunked head equals log_softmax(model(ids).logits) bit for bit: one chunk
    (2 x 21 rows), and chunks of 16 rows with a longer last one (3 x 50 rows: 16 x 8 + 22)."""
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(5)
    assert head_rows(VOCAB, torch.device("cpu")) == 2**18 // VOCAB
    monkeypatch.setattr("moesub.models.nll.head_rows", lambda vocab, device: 16)
    for B, T in [(2, 21), (3, 50)]:
        ids = torch.randint(0, VOCAB, (B, T), generator=gen)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), dim=-1)
        ref = -lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).double().numpy()
        nll = stream_nll(model, ids)
        assert nll.shape == (B, T) and np.isnan(nll[:, 0]).all()
        np.testing.assert_array_equal(nll[:, 1:], ref)
    with pytest.raises(ValueError, match="input_ids"):
        stream_nll(model, ids[0])
