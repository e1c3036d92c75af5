"""A checkpoint that does not fit one device (config `models.<name>.loading`, issue 13 item 7):
capture and emulation of a tiny Qwen3-Next checkpoint placed by Accelerate, with `max_memory`
pushing some decoder layers to disk offload (this machine has no GPU: "cpu" + "disk"; an
explicit device_map also puts the input embedding on disk, so the input device is not the
first parameter's). The split model must capture the unsplit model's NLL and router logits bit
for bit (disk offload reloads the same float32 values and computes on the same CPU), and its
`fetch_every_miss` emulation must reproduce its own captured NLL bit for bit."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import yaml
from fixtures_artefacts import write_ranking
from tiny_models import random_streams, tiny_qwen3_next

from moesub import config as mcfg
from moesub.artefacts import load_trace
from moesub.capture import run_capture
from moesub.emulate import run_emulate
from moesub.io import write_parquet
from moesub.models import ModelLoading, input_device, load_model, moe_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, E, K, L, C, FRACTION = 97, 16, 4, 4, 6, 0.375
SUBSTITUTING = {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5, "delay": 1}
# The input embedding and half the layers on disk: the input device is the embedding's
# execution device (cpu), while its weight sits on the meta device.
EXPLICIT_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.rotary_emb": "cpu",
    "model.norm": "disk",
    "lm_head": "disk",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_map")
    model = tiny_qwen3_next(vocab=VOCAB, layers=L, experts=E, k=K, expert_std=0.4)
    model.save_pretrained(root / "model")
    # two equal lengths: the capture batches them into one forward
    write_parquet(random_streams([30, 30, 21], VOCAB, seed=7), root / "streams.parquet")
    rng = np.random.default_rng(1)
    initial = np.stack([rng.permutation(E)[:C] for _ in range(L)])  # (L, C)
    write_ranking(root / "ranking.parquet", initial, E)
    return root


@pytest.fixture(scope="module")
def split(root):
    """`auto` placement with a CPU budget of 80% of the weights: the embedding and the first
    two layers stay in RAM, the others are offloaded to disk (Accelerate keeps room for the
    largest offloaded layer, loaded for its forward; the split is checked, not assumed)."""
    model, _ = load_model(root / "model")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loading = {
        "device_map": "auto",
        "max_memory": {"cpu": int(0.8 * weight_bytes)},
        "offload_folder": str(root / "offload"),
    }
    placed, _ = load_model(root / "model", loading=loading)
    layers = {k: v for k, v in placed.hf_device_map.items() if k.startswith("model.layers.")}
    assert "cpu" in layers.values() and "disk" in layers.values(), placed.hf_device_map
    return loading


def capture(root, name, loading=None):
    params = {"name": "tiny", "batch_tokens": 64}  # the two 30-token streams in one forward
    if loading is not None:
        params["loading"] = loading
    tokens, router = root / f"{name}_tokens.parquet", root / f"{name}_router.parquet"
    if not tokens.exists():
        run_capture(root / "model", root / "streams.parquet", tokens, router, params)
    return tokens, router


def emulate(root, tokens, policy, out, loading=None):
    params = {"progress": False} if loading is None else {"progress": False, "loading": loading}
    path = run_emulate(
        root / "model", tokens, root / "ranking.parquet", "p", policy, FRACTION,
        root / "out" / out, params,
    )  # fmt: skip
    return pl.read_parquet(path)


def nll(path) -> np.ndarray:
    return pl.read_parquet(path)["nll"].fill_null(np.nan).to_numpy()


@pytest.mark.parametrize("placement", ["max_memory", "explicit_map"])
def test_split_capture_equals_unsplit_bit_for_bit(root, split, placement):
    loading = split if placement == "max_memory" else {"device_map": EXPLICIT_MAP}
    ref_tokens, ref_router = capture(root, "whole")
    tokens, router = capture(root, placement, loading)
    assert np.array_equal(nll(tokens), nll(ref_tokens), equal_nan=True)
    got, ref = load_trace(router, lookahead=True), load_trace(ref_router, lookahead=True)
    assert got.streams == ref.streams
    for a, b in zip(got.logits + got.lookahead, ref.logits + ref.lookahead, strict=True):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b)


@pytest.mark.parametrize("placement", ["max_memory", "explicit_map"])
def test_split_emulation_is_exact(root, split, placement):
    """fetch_every_miss on the split model reproduces its captured NLL bit for bit; a
    substituting policy (the hook's replacement ids reach offloaded layers) makes the same
    decisions and NLL as on the unsplit model."""
    loading = split if placement == "max_memory" else {"device_map": EXPLICIT_MAP}
    tokens, _ = capture(root, placement, loading)
    fem = emulate(root, tokens, {"rule": "fetch_all"}, f"{placement}_fem.parquet", loading)
    assert np.array_equal(fem["nll"].fill_null(np.nan).to_numpy(), nll(tokens), equal_nan=True)
    ref_tokens, _ = capture(root, "whole")
    sub = emulate(root, tokens, SUBSTITUTING, f"{placement}_sub.parquet", loading)
    ref = emulate(root, ref_tokens, SUBSTITUTING, "whole_sub.parquet")
    assert sub["sub"].sum() > 0
    assert sub.equals(ref)


def test_capture_and_emulate_place_the_model(root, split, monkeypatch):
    """The stages really load the model with the placement their params carry."""
    import moesub.models
    import moesub.replay

    placements = []

    def recording_load_model(*args, **kwargs):
        model, tokenizer = load_model(*args, **kwargs)
        placements.append(getattr(model, "hf_device_map", None))
        return model, tokenizer

    monkeypatch.setattr(moesub.models, "load_model", recording_load_model)
    monkeypatch.setattr(moesub.replay, "load_model", recording_load_model)
    tokens, _ = capture(root, "placed_check", split)
    emulate(root, tokens, {"rule": "fetch_all"}, "placed_check.parquet", split)
    assert len(placements) == 2
    assert all("disk" in p.values() and "cpu" in p.values() for p in placements), placements


def test_input_device_of_a_placed_model(root):
    """The embedding's weight is offloaded (meta) but the inputs go to its execution device;
    the router hook sees every layer's ids on the device that layer runs on."""
    model, _ = load_model(root / "model", loading={"device_map": EXPLICIT_MAP})
    assert model.get_input_embeddings().weight.device.type == "meta"
    assert input_device(model) == torch.device("cpu")
    assert len(moe_blocks(model)) == L
    whole, _ = load_model(root / "model")
    assert input_device(whole) == torch.device("cpu")


def test_offload_folder_is_per_load_and_removed_with_the_model(root, split):
    parent = root / "offload_parent"
    loading = {**split, "offload_folder": str(parent)}
    a, _ = load_model(root / "model", loading=loading)
    b, _ = load_model(root / "model", loading=loading)
    dirs = sorted(parent.iterdir())
    assert len(dirs) == 2 and all(any(d.iterdir()) for d in dirs)  # fused experts rewritten
    del a, b
    gc.collect()
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize(
    ("loading", "match"),
    [
        ({"max_memory": {"cpu": "1GiB"}}, "loading.max_memory is set but loading.device_map"),
        ({"offload_folder": "/tmp/x"}, "loading.offload_folder is set but"),
        ({"device_map": "fastest"}, "loading.device_map: 'fastest' is not one of"),
        ({"device_map": {}}, "non-empty"),
        ({"device_map": {"model": "gpu"}}, r"loading.device_map\['model'\]: 'gpu' is not a"),
        ({"device_map": "auto", "max_memory": {"cpu": "lots"}}, r"max_memory\['cpu'\]: 'lots'"),
        ({"device_map": "auto", "max_memory": {"cuda:7": "1GiB"}}, "CUDA device 7"),
        ({"device_map": {"": "cpu"}, "max_memory": {"cpu": 1}}, "explicit device_map"),
        ({"devicemap": "auto"}, r"unknown model loading option\(s\) \['devicemap'\]"),
    ],
)
def test_loading_errors_name_the_key(loading, match):
    with pytest.raises(ValueError, match=match):
        ModelLoading.from_dict(loading)


def test_stage_params_check_loading_before_any_work(root):
    with pytest.raises(ValueError, match="loading.device_map"):
        capture(root, "bad", {"device_map": "fastest"})
    assert not (root / "bad_tokens.parquet").exists()


def config_with(tmp_path, loading) -> Path:
    """A minimal pipeline config whose one model has `loading`."""
    cfg = {
        "models": {"m": {"embedded": True, "loading": loading}},
        "streams": {"source": {"kind": "embedded"}},
        "fractions": [0.25],
        "policies": {"fetch_every_miss": {"rule": "fetch_all"}},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("loading", "key"),
    [
        ({"device_map": "fastest"}, "models.m.loading.device_map"),
        ({"device_map": {"model.layers.0": "gpu"}}, "models.m.loading.device_map"),
        ({"device_map": "auto", "max_memory": {"ram": "1GiB"}}, "models.m.loading.max_memory"),
        ({"device_map": "auto", "max_memory": {"cpu": "1 lot"}}, "models.m.loading.max_memory"),
        ({"device_map": "auto", "offload": "/tmp"}, "models.m.loading"),
    ],
)
def test_config_schema_rejects_bad_loading(tmp_path, loading, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        mcfg.load_config(config_with(tmp_path, loading))


def test_config_schema_accepts_a_placement(tmp_path):
    loading = {
        "device_map": "auto",
        "max_memory": {"cuda:0": "70GiB", "1": "70GiB", "cpu": "200GiB", "disk": 2**40},
        "offload_folder": "/scratch/offload",
    }
    assert mcfg.load_config(config_with(tmp_path, loading))["models"]["m"]["loading"] == loading
