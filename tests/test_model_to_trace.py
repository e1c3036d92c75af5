"""Issue 3 end to end: train the test-size embedded model, reload it with the Auto classes, build
streams, capture, and check the trace against an independent plain forward pass."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_embedded import TINY
from transformers import AutoModelForCausalLM, AutoTokenizer

from moesub.artefacts import load_trace, read_expert_ranking
from moesub.capture import run_capture, run_expert_ranking
from moesub.embedded import build_model
from moesub.grid import GridPoint, simulate
from moesub.io import read_metadata
from moesub.models import stream_batches
from moesub.policy import Policy, capacity_for
from moesub.streams import build_streams


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2t")
    model_dir = build_model(root / "model", TINY)
    params = {
        "eval": {"n_streams": 2, "stream_len": 96},
        "calib": {"n_streams": 2, "stream_len": 96},
    }
    build_streams(
        model_dir, {"kind": "embedded"}, params, root / "eval.parquet", root / "calib.parquet"
    )
    for split in ("eval", "calib"):
        run_capture(
            model_dir,
            root / f"{split}.parquet",
            root / f"{split}_tokens.parquet",
            root / f"{split}_router.parquet",
            {"device": "cpu", "dtype": "float32"},
        )
    return root, model_dir


def test_reload_with_auto_classes_and_capture_matches_plain_forward(captured):
    root, model_dir = captured
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == TINY["vocab_size"]
    assert type(model).__name__ == "Qwen3NextForCausalLM"

    tokens = pq.read_table(root / "eval_tokens.parquet")
    assert tokens.column_names == ["stream", "pos", "token_id", "doc_id", "doc_start", "nll"]
    router = pq.read_table(root / "eval_router.parquet")
    assert router.column_names == ["stream", "pos", "layer", "logits", "lookahead"]
    assert router.schema.field("logits").type.byte_width == 4 * TINY["num_experts"]
    meta = read_metadata(root / "eval_router.parquet")
    assert (meta["num_experts"], meta["top_k"], meta["num_layers"]) == (64, 4, 2)
    assert meta["norm_topk_prob"] is True

    # the plain forward batches the streams as the capture did (same (B, T) per forward)
    t = tokens.to_pandas()
    groups = [g for _, g in t.groupby("stream", sort=True)]
    batch_tokens = read_metadata(root / "eval_tokens.parquet")["batch_tokens"]
    trace = load_trace(root / "eval_router.parquet")
    for batch in stream_batches([len(g) for g in groups], batch_tokens):
        ids = torch.tensor(np.stack([groups[b]["token_id"].to_numpy() for b in batch]))  # (B, T)
        with torch.no_grad():
            out = model(ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits.float(), -1).double()  # (B, T, V)
        plain = -logp[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2).numpy()  # (B, T-1)
        for row, b in enumerate(batch):
            g = groups[b]
            np.testing.assert_allclose(g["nll"].to_numpy()[1:], plain[row], rtol=0, atol=1e-6)
            assert np.isnan(g["nll"].to_numpy()[0])
            # router logits: the trace equals the model's own output_router_logits
            i = trace.streams.index(int(g["stream"].iloc[0]))
            T = len(g)
            for layer, lg in enumerate(out.router_logits):  # (B*T, E), batch-major
                got = lg[row * T : (row + 1) * T].float().numpy()
                np.testing.assert_array_equal(trace.logits[i][:, layer], got)


def test_expert_ranking_and_simulation_on_the_captured_trace(captured):
    root, _ = captured
    run_expert_ranking(root / "calib_router.parquet", root / "ranking.parquet")
    init = read_expert_ranking(root / "ranking.parquet", 2, 64)[:, : capacity_for(0.25, 64)]
    assert init.shape == (2, 16)
    trace = load_trace(root / "eval_router.parquet")
    df = simulate(trace.logits, 4, [GridPoint("fem", Policy(), 16, init)])
    total = df.filter(df["layer"] == -1).row(0, named=True)
    assert 0 < total["hit_rate"] <= total["belady_hit_rate"] <= 1
