"""moesub.engine under policy semantics v3 on a model (tiny random Qwen3-Next, E=16, k=4, C=6):
the practitioners' designs against the emulator, and the lossless ones against the exact model.

Under admission="delay" teacher forcing gives the emulator's per-token status counts, its
per-token-layer counts (`TOKEN_LAYER_FIELDS`: the core's scan over the emulator's own router
logits), NLL and mass; greedy generation its tokens. A lossless v3 policy (host_compute with
uploads, pinned fetch_all, host-computed light misses with uploads) reproduces the captured NLL
bit for bit on the emulator, and on the engine the engine's own exact decode (fetch_every_miss)
bit for bit: every rank's row is summed once wherever it was computed. The engine's KV-cache
decode differs from the capture's one full forward by float rounding only (5e-6, as for
fetch_every_miss in tests/test_engine.py). Uniform capacities and one pin for every layer: the
emulator's caches take those (per-layer ones: tests/test_engine_v3.py, against the core)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_emulate import VOCAB, K
from test_engine_generate import engine_equals_emulator, make_stage, params

from moesub.emulate import emulate_stream
from moesub.engine import open_engine
from moesub.models import stream_nll
from moesub.policy import HOST, Policy, scan, token_layer_counts

FRACTION, C = 0.375, 6
# the practitioners' designs at C = 6, k = 4 (the most slots a pin leaves a k-slot pool is
# C - k = 2: "half of the slots" and "all but k" are both 2 here) and two hybrids with uploads
V3 = {
    "llama_cpp_27861": {"rule": "host_compute", "host_admit": 2},
    "fitz_tec_pins": {"rule": "fetch_all", "pin": 2},
    "static_keep_set": {"rule": "first_choice", "pin": 2},
    "quality_pinned": {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5, "pin": 1},
    "hybrid_upload": {"rule": "threshold", "tau": 0.15, "light_miss": "host", "host_admit": 1},
}
LOSSLESS = ("llama_cpp_27861", "fitz_tec_pins", "hybrid_upload")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root, model, initial, rng = make_stage(tmp_path_factory.mktemp("engine_v3"))
    return root, model, initial, rng.integers(3, VOCAB, 24)


def engine(stage, name, policy, **kw):
    root, _model, initial, _seq = stage
    return open_engine(
        root / "model", name, policy, FRACTION, "cpu", initial,
        params(root, admission="delay", **kw),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(V3))
def test_v3_policy_on_the_engine_equals_the_emulator(stage, name):
    _root, model, initial, seq = stage
    pol = Policy.from_dict(V3[name])
    trace = emulate_stream(model, seq, pol, C, initial, record=True)
    with engine(stage, name, V3[name]) as eng:
        r, _res = engine_equals_emulator(eng, model, seq, trace, pol, initial)
    assert np.array_equal(r["layer_counts"], token_layer_counts(scan(trace.logits, K, C, pol,
                                                                    initial=initial)))  # fmt: skip
    if pol.host_admit:  # uploads were requested, copied in the background and installed
        assert (r["counts"][:, HOST] > 0).any()
        assert r["admissions"] > 0 and r["bytes_bg"].sum() > 0
        assert r["layer_counts"][..., -1].sum() == r["admitted"].sum()


def test_lossless_v3_policies_are_exact(stage):
    """The emulator: the captured (one full forward) NLL bit for bit. The engine: its own exact
    decode's NLL bit for bit, and the capture's up to the KV-cache decode's rounding."""
    _root, model, initial, seq = stage
    captured = stream_nll(model, torch.as_tensor(seq[None]))[0]
    with engine(stage, "fetch_every_miss", {"rule": "fetch_all"}) as eng:
        exact = eng.decode(seq)["nll"]
    np.testing.assert_allclose(exact[1:], captured[1:], rtol=0, atol=5e-6)
    for name in LOSSLESS:
        pol = Policy.from_dict(V3[name])
        emulated = emulate_stream(model, seq, pol, C, initial).nll
        assert np.array_equal(emulated, captured, equal_nan=True), name
        with engine(stage, name, V3[name]) as eng:
            r = eng.decode(seq)
        assert r["counts"][:, HOST].sum() > 0 or pol.pin, name  # the host really computed
        assert np.array_equal(r["nll"], exact, equal_nan=True), name
