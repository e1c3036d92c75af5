"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: on a shared, loaded machine one torch thread is far faster than two (threads
    only add synchronisation). Modules opt in with `pytestmark`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Experiment B's stage inputs (tests/test_expb_matched.py, tests/test_expb_factorial.py): one
# tiny model, its calibration and evaluation captures and its expert ranking, built once
EXPB_VOCAB, EXPB_E, EXPB_K, EXPB_L = 97, 24, 8, 3


@pytest.fixture(scope="session")
def expb_inputs(tmp_path_factory):
    from tiny_models import random_streams, tiny_qwen3_next

    from moesub.capture import run_capture, run_expert_ranking
    from moesub.io import write_parquet

    root = tmp_path_factory.mktemp("expb_inputs")
    model = tiny_qwen3_next(
        vocab=EXPB_VOCAB, layers=EXPB_L, experts=EXPB_E, k=EXPB_K, special_tokens=False,
        gate_std=0.6, layer_types=["linear_attention", "linear_attention", "full_attention"],
        expert_std=0.4,
    )  # fmt: skip
    model.save_pretrained(root / "model")
    for split, seed in (("calib", 1), ("eval", 2)):
        streams = root / f"{split}_streams.parquet"
        write_parquet(random_streams([64] * 4, EXPB_VOCAB, seed), streams)
        run_capture(
            root / "model", streams, root / f"{split}_tokens.parquet",
            root / f"{split}_router.parquet", {"batch_tokens": 128},
        )  # fmt: skip
    run_expert_ranking(root / "calib_router.parquet", root / "ranking.parquet")
    return root


@pytest.fixture(scope="module")
def expb_stage(expb_inputs, tmp_path_factory):
    """A directory of the module's own with the shared inputs linked in: its outputs stay apart."""
    root = tmp_path_factory.mktemp("expb_stage")
    for path in expb_inputs.iterdir():
        (root / path.name).symlink_to(path)
    return root
