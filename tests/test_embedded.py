"""The embedded default model: corpus split, tokenizer, training, atomic build."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from moesub import corpus, embedded
from moesub.corpus import collect_corpus, split_of
from moesub.embedded import build_model, training
from moesub.embedded.config import EmbeddedConfig, model_config

# A test-size model: trains in a few seconds on 2 cores; a token budget keeps it deterministic.
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "full_attention_interval": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 64,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 16,
    "vocab_size": 512,
    "seq_len": 64,
    "batch_size": 4,
    "warmup_steps": 5,
    "train_seconds": None,
    "max_tokens": 64 * 4 * 30,
    "eval_tokens": 2048,
    "train_max_bytes": 300_000,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("embedded") / "model"
    build_model(out, TINY)
    return out


def _fake_stdlib(root: Path) -> Path:
    files = {
        "abc.py": "class ABC: pass\n",
        "json/__init__.py": '"""JSON."""\nimport json.decoder\n',
        "json/decoder.py": "def decode(s):\n    return s\n",
        "json/tests/test_json.py": "assert True\n",
        "test/test_abc.py": "import abc\n",
        "idlelib/idle_test/test_x.py": "x = 1\n",
        "idlelib/editor.py": "class Editor: pass\n",
        "site-packages/foo/__init__.py": "foo = 1\n",
        "__pycache__/abc.cpython-311.py": "stale\n",
        "_sysconfigdata__linux.py": "build_time_vars = {}\n",
        "latin1.py": b"# caf\xe9\n",
        "encodings/cp999.py": '""" Codec cp999 generated from X.TXT with gencodec.py.\n"""\n',
        "encodings/utf_8.py": '""" Python utf-8 Codec\n"""\n',
        "empty.py": "\n",
        "pydoc_data/__init__.py": "",
        "pydoc_data/topics.py": "topics = {'if': 'The if statement.\\n', 'while': 'Loops.\\n'}\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    return root


def test_corpus_filters_and_packages(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    docs, texts = collect_corpus(EmbeddedConfig(), root)
    paths = [d.path for d in docs]
    assert paths == sorted(paths)
    assert paths == [
        "abc.py",
        "encodings/utf_8.py",
        "idlelib/editor.py",
        "json/__init__.py",
        "json/decoder.py",
        "pydoc_data/topics.py#if",
        "pydoc_data/topics.py#while",
    ]
    by_path = {d.path: d for d in docs}
    assert by_path["json/decoder.py"].package == "json"
    assert by_path["abc.py"].package == "abc"
    assert by_path["pydoc_data/topics.py#if"].kind == "text"
    assert by_path["pydoc_data/topics.py#if"].package == "pydoc_data"
    assert texts[paths.index("pydoc_data/topics.py#while")] == "Loops.\n"
    assert by_path["json/decoder.py"].nbytes == len(b"def decode(s):\n    return s\n")
    for doc, text in zip(docs, texts, strict=True):
        assert corpus.read_document(doc.path, root) == text


def test_corpus_without_test_suite_or_pydoc(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("x = 1\n")
    docs, _ = collect_corpus(EmbeddedConfig(), root)
    assert [d.path for d in docs] == ["pkg/__init__.py"]
    with pytest.raises(FileNotFoundError, match="root"):
        collect_corpus(EmbeddedConfig(), tmp_path / "missing")


def test_split_is_stable_hash_and_disjoint():
    cfg = EmbeddedConfig(calib_fraction=0.1, eval_fraction=0.2)
    docs_a, _ = collect_corpus(cfg)
    docs_b, _ = collect_corpus(cfg)
    assert docs_a == docs_b
    assert len({d.path for d in docs_a}) == len(docs_a)  # each document in exactly one split
    counts = {s: sum(d.split == s for d in docs_a) for s in corpus.SPLITS}
    assert all(n > 0 for n in counts.values())
    assert abs(counts["eval"] / len(docs_a) - 0.2) < 0.07
    for d in docs_a:
        u = int(hashlib.sha256(d.path.encode()).hexdigest()[:16], 16) / 2.0**64
        expected = "eval" if u < 0.2 else "calib" if u < 0.3 else "train"
        assert d.split == expected
        parts = d.path.split("/")
        assert not {"test", "tests", "site-packages", "idle_test"} & set(parts[:-1])
    # the split does not depend on the seed
    assert split_of("json/decoder.py", 0.1, 0.2) == split_of("json/decoder.py", 0.1, 0.2)


def test_tokenizer_is_deterministic():
    texts = [f"def f{i}(x):\n    return x * {i}  # comment {i}\n" for i in range(200)]
    a = corpus.train_tokenizer(texts, 300)
    b = corpus.train_tokenizer(texts, 300)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 300
    assert a.convert_tokens_to_ids(corpus.EOS_TOKEN) == 0


def test_tokenizer_round_trip_via_auto_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) == TINY["vocab_size"]
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (
        corpus.EOS_TOKEN,
        corpus.BOS_TOKEN,
        corpus.PAD_TOKEN,
    )
    assert len({tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}) == 3
    text = 'def héllo(x):\n\t"""∑ of x."""\n    return x  # 😀\n\n'
    ids = tok(text)["input_ids"]
    assert tok.bos_token_id not in ids  # no special tokens added
    assert tok.decode(ids) == text
    assert max(ids) < TINY["vocab_size"]


def test_build_writes_a_loadable_checkpoint(tiny_model):
    from transformers import AutoModelForCausalLM

    names = {p.name for p in tiny_model.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "train_log.parquet",
        "corpus_files.parquet",
        "train_summary.json",
    } <= names
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (64, 4, True)
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    assert model.model.layers[0].mlp.shared_expert is not None

    log = pq.read_table(tiny_model / "train_log.parquet").to_pydict()
    assert {"step", "tokens", "loss", "lr", "elapsed_s"} <= set(log)
    summary = json.loads((tiny_model / "train_summary.json").read_text())
    steps = TINY["max_tokens"] // (TINY["seq_len"] * TINY["batch_size"])
    assert log["step"] == list(range(1, steps + 1))
    assert summary["steps"] == steps and summary["stopped_on"] == "max_tokens"
    assert summary["tokens_seen"] == log["tokens"][-1] == steps * 64 * 4
    assert np.all(np.diff(log["elapsed_s"]) >= 0)
    assert log["loss"][-1] < log["loss"][0]  # it learned something
    assert summary["config"]["num_experts"] == 64
    assert 1 < summary["heldout_perplexity"] < TINY["vocab_size"]

    files = pq.read_table(tiny_model / "corpus_files.parquet").to_pydict()
    assert set(files) >= {"path", "split", "package", "bytes"}
    assert set(files["split"]) == {"train", "calib", "eval"}

    # the saved weights reproduce the recorded held-out perplexity
    docs, texts = collect_corpus(EmbeddedConfig(**TINY))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    eval_texts = [t for d, t in zip(docs, texts, strict=True) if d.split == "eval"]
    eval_ids = corpus.encode_documents(tok, eval_texts, "eval", tok.eos_token_id)
    ppl = training.heldout_perplexity(model, eval_ids, TINY["seq_len"], TINY["eval_tokens"])
    assert math.isclose(ppl["perplexity"], summary["heldout_perplexity"], rel_tol=1e-5)


def test_same_seed_same_weights(tiny_model, tmp_path):
    from safetensors.torch import load_file

    again = build_model(tmp_path / "again", TINY)
    a = load_file(tiny_model / "model.safetensors")
    b = load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", ["train", "heldout_perplexity"])
def test_failed_build_leaves_nothing(stage, tmp_path, monkeypatch):
    written = []

    def boom(*args, **kwargs):
        written.extend(p.name for p in tmp_path.glob(".model.*/*"))
        raise RuntimeError("injected failure")

    monkeypatch.setattr(embedded, stage, boom)
    out = tmp_path / "model"
    with pytest.raises(RuntimeError, match="injected"):
        build_model(out, {**TINY, "max_tokens": 256})
    assert "tokenizer.json" in written  # the temp dir held partial output when it failed
    assert list(tmp_path.iterdir()) == []

    # an existing output survives a failed rebuild untouched
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(RuntimeError, match="injected"):
        build_model(out, {**TINY, "max_tokens": 256})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (out / "keep.txt").read_text() == "old"


def test_rebuild_replaces_existing_dir(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    build_model(out, {**TINY, "max_tokens": 256})
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"hidden_sizes": 32}, "hidden_sizes"),
        ({"num_experts": 4, "num_experts_per_tok": 8}, "num_experts_per_tok"),
        ({"train_seconds": None, "max_tokens": None}, "budget"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"eval_fraction": 0.6, "calib_fraction": 0.5}, "fractions"),
        ({"seq_len": 1}, "seq_len"),
        ({"balance_pooling": "sequence"}, "balance_pooling"),
        ({"balance_ema_steps": 0.5}, "balance_ema_steps"),
        ({"router_z_loss_coef": -1.0}, "router_z_loss_coef"),
        ({"router_lr_scale": 0.0}, "router_lr_scale"),
        ({"dense_layers": 4}, "dense_layers"),
    ],
)
def test_bad_params(params, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        build_model(tmp_path / "m", params)
    assert not (tmp_path / "m").exists()


def test_lr_schedule():
    cfg = EmbeddedConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert training.lr_at(0, cfg, 0.0) == pytest.approx(1e-4)
    assert training.lr_at(9, cfg, 0.0) == pytest.approx(1e-3)
    assert training.lr_at(10, cfg, 0.0) == pytest.approx(1e-3)
    assert training.lr_at(50, cfg, 0.5) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert training.lr_at(99, cfg, 1.0) == pytest.approx(1e-4)
    assert training.lr_at(99, cfg, 3.0) == pytest.approx(1e-4)


def test_wall_clock_budget_stops_training():
    from transformers import Qwen3NextForCausalLM

    cfg = EmbeddedConfig.from_params({**TINY, "train_seconds": 1.0, "max_tokens": None})
    tok = corpus.train_tokenizer(["x = 1\n" * 50, "def f(): pass\n" * 50], 300)
    cfg.vocab_size = 300
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(model_config(cfg, tok))
    tokens = np.random.default_rng(0).integers(0, 300, size=5000).astype(np.int32)
    log, facts = training.train(model, tokens, cfg)
    assert facts["stopped_on"] == "time"
    assert 1.0 <= facts["train_time_s"] < 30.0
    assert facts["steps"] == len(log["step"]) >= 1
    with pytest.raises(ValueError, match="seq_len"):
        training.train(model, tokens[:10], cfg)


def _router_losses(**params) -> training.RouterLosses:
    cfg = EmbeddedConfig.from_params({**TINY, "num_experts": 8, "num_experts_per_tok": 2, **params})
    return training.RouterLosses(cfg, num_layers=1)


def test_global_balance_loss_is_k_when_uniform_and_pools_f_by_ema():
    losses = _router_losses(balance_pooling="global", balance_ema_steps=4)
    # uniform router probabilities: E * sum_e f_e / E = sum_e f_e = k, whatever f is
    terms = losses((torch.zeros(6, 8),))
    assert float(terms["aux_loss"]) == pytest.approx(2.0)
    assert "z_loss" not in terms
    # the EMA moved 1/4 of the way from uniform (k/E) to that step's f, which sums to k
    share = losses.share[0]
    assert float(share.sum()) == pytest.approx(2.0)
    assert sorted(set(share.tolist())) == pytest.approx([0.75 * 2 / 8, 0.75 * 2 / 8 + 0.25])
    # the gradient flows through P only: d loss / d P_e = E * share_e (f carries none)
    z = torch.randn(5, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    share_before = losses.share[0].clone()
    terms = losses((z,))
    terms["aux_loss"].backward()
    f = torch.zeros(8)
    for e in z.detach().topk(2, dim=-1).indices.reshape(-1):  # no ties in random logits
        f[e] += 1 / 5
    share = 0.75 * share_before + 0.25 * f
    z2 = z.detach().clone().requires_grad_(True)
    (8 * (share * torch.softmax(z2, dim=-1).mean(0)).sum()).backward()
    torch.testing.assert_close(z.grad, z2.grad)


def test_micro_batch_pooling_leaves_balancing_to_the_model_and_z_loss():
    assert _router_losses(balance_pooling="micro_batch")((torch.zeros(3, 8),)) == {}
    losses = _router_losses(router_z_loss_coef=1e-3)
    terms = losses((torch.full((4, 8), 2.0), torch.zeros(4, 8)))
    # logsumexp of 8 equal logits c is c + log 8; mean over the two layers
    expect = ((2 + math.log(8)) ** 2 + math.log(8) ** 2) / 2
    assert float(terms["z_loss"]) == pytest.approx(expect)


def test_global_pooling_build_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    params = {**TINY, "balance_pooling": "global", "router_z_loss_coef": 1e-3}
    params["max_tokens"] = 64 * 4 * 8
    a, b = build_model(tmp_path / "a", params), build_model(tmp_path / "b", params)
    wa, wb = (load_file(p / "model.safetensors") for p in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    log = pq.read_table(a / "train_log.parquet").to_pydict()
    assert all(v > 0 for v in log["aux_loss"]) and all(v > 0 for v in log["z_loss"])


def test_router_lr_scale_puts_the_routers_in_their_own_group():
    from transformers import Qwen3NextForCausalLM

    cfg = EmbeddedConfig.from_params({**TINY, "vocab_size": 300, "router_lr_scale": 10.0})
    tok = corpus.train_tokenizer(["x = 1\n" * 50, "def f(): pass\n" * 50], 300)
    model = Qwen3NextForCausalLM(model_config(cfg, tok))
    opt = training._optimizer(model, cfg)
    routers = {id(layer.mlp.gate.weight) for layer in model.model.layers}
    scaled = [g for g in opt.param_groups if g["lr_scale"] != 1.0]
    assert len(scaled) == 1 and scaled[0]["lr_scale"] == 10.0
    assert {id(p) for p in scaled[0]["params"]} == routers
    assert scaled[0]["weight_decay"] == cfg.weight_decay
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))


def test_dense_layers_put_a_dense_mlp_of_the_active_width_first():
    from transformers import Qwen3NextForCausalLM

    from moesub.models import moe_info

    cfg = EmbeddedConfig.from_params({**TINY, "vocab_size": 300, "dense_layers": 1})
    tok = corpus.train_tokenizer(["x = 1\n" * 50, "def f(): pass\n" * 50], 300)
    model = Qwen3NextForCausalLM(model_config(cfg, tok))
    info = moe_info(model)
    assert info.layer_indices == tuple(range(1, cfg.num_hidden_layers))
    width = cfg.num_experts_per_tok * cfg.moe_intermediate_size
    width += cfg.shared_expert_intermediate_size
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (width, cfg.hidden_size)
