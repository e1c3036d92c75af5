"""moesub.engine generation: free-running greedy decoding on the offloading engine (prompt fed one
token per step, then argmax fed back) against the exact model and the emulator's decode mode
(`moesub.emulate.greedy_decode`), the engine's admission="delay" timing against the policy core's
whole-stream `scan`, stop ids, and input checks. Tiny random Qwen3-Next model (E=16, k=4, C=6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_emulate import VOCAB, E, K, L, tiny_model  # the one tiny-model builder

from moesub.emulate import emulate_stream
from moesub.engine import EngineDecodeResult, generate, open_engine
from moesub.engine.runtime import OffloadEngine
from moesub.engine.store import ExpertStore, StoreLayout, random_experts, write_store
from moesub.engine.tiers import DiskTier
from moesub.greedy import greedy_decode
from moesub.policy import HOST, SUB, Policy, scan, token_layer_counts
from moesub.synthetic import synthetic_logits

FRACTION, C = 0.375, 6
QUALITY = {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5}
SPEED = {"rule": "first_choice", "eviction": "lfu", "beta": 0.5}
# prompts of 1 to 9 tokens; under QUALITY the second one triggers background admissions
PROMPTS = [[75], [52, 84, 46, 37, 8, 45], [89, 43, 6, 70], [63, 75, 83, 23, 58, 78, 27, 35, 81]]
NEW = 12
ACT = torch.nn.functional.silu


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_stage(root):
    """The tiny model saved under `root` and a random (L, C) initial set: (root, model, initial,
    the generator that drew the set, for more draws)."""
    model = tiny_model()
    model.save_pretrained(root / "model")
    rng = np.random.default_rng(1)
    initial = np.stack([rng.permutation(E)[:C] for _ in range(L)]).astype(np.int32)
    return root, model, initial, rng


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    return make_stage(tmp_path_factory.mktemp("engine_generate"))[:3]


def params(root, **kw):
    return {"store_path": str(root / "experts.bin"), "progress": False, **kw}


@pytest.fixture(scope="module")
def exact(stage):
    """The exact model's greedy continuations (the emulator's decode mode, no policy)."""
    return greedy_decode(stage[1], PROMPTS, None, C, None, NEW)


@pytest.fixture(scope="module")
def quality_engine(stage):
    root, _model, initial = stage
    eng = open_engine(
        root / "model", "quality", QUALITY, FRACTION, "cpu", initial,
        params(root, admission="delay"),
    )  # fmt: skip
    yield eng
    eng.close()


# --------------------------------------------------------------------------- driver level
@pytest.mark.parametrize(
    "policy",
    [
        Policy(rule="first_choice", eviction="lfu", beta=0.5),
        Policy(rule="threshold", tau=0.3, eviction="lru", beta=0.3, delay=2),
    ],
)
def test_delay_admission_reproduces_the_core_scan(tmp_path, policy):
    """admission="delay": every decision equals the core's own fixed-delay scan, even with one
    staging buffer (several due copies per token queue behind each other), and so does every
    token-layer's counts (the pricing's input: admissions landed included)."""
    lay = StoreLayout(2, E, 24, 8, "float32", fingerprint="test")
    write_store(tmp_path / "x.bin", lay, random_experts(lay, 0), progress=False)
    trace = synthetic_logits(80, lay.num_layers, E, seed=4)  # (T, L, E)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    tier = DiskTier(store, C, K, ACT, staging_buffers=1)
    engine = OffloadEngine(tier, E, K, C, policy, None, ACT, admission="delay")
    ids, status, bytes_bg, counts = [], [], 0, []
    try:
        for t in range(trace.shape[0]):
            engine.begin_token()
            steps = [engine.route(layer, trace[t, layer][None]) for layer in range(lay.num_layers)]
            ids.append([s.ids[0] for s in steps])
            status.append([s.status[0] for s in steps])
            st = engine.end_token()
            bytes_bg += st.bytes_bg
            counts.append(st.layer_counts)
        installed = sum(c.counters()["admissions"] for c in engine.caches)
    finally:
        engine.close()
    ref = scan(trace, K, C, policy)
    assert np.array_equal(np.array(status), ref.status)
    assert np.array_equal(np.array(ids), ref.ids)
    np.testing.assert_array_equal(np.array(counts), token_layer_counts(ref))
    assert installed > 0 and 0 < bytes_bg <= installed * lay.expert_bytes
    with pytest.raises(ValueError, match="admission='soon'"):
        OffloadEngine(DiskTier(ExpertStore(tmp_path / "x.bin"), C, K, ACT), E, K, C, policy,
                      None, ACT, admission="soon")  # fmt: skip


# --------------------------------------------------------------------------- generation
def test_fetch_every_miss_generates_the_exact_model(stage, exact):
    root, model, initial = stage
    res = generate(
        root / "model", PROMPTS, NEW, name="fetch_every_miss", policy={"rule": "fetch_all"},
        fraction=FRACTION, initial=initial, params=params(root),
    )  # fmt: skip
    # greedy_decode(policy=None) is transformers' own greedy generate (tests/test_emulate.py)
    hf = model.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )[0, len(PROMPTS[0]) :].tolist()
    assert res[0].tokens == hf
    for prompt, r, x in zip(PROMPTS, res, exact, strict=True):
        assert isinstance(r, EngineDecodeResult)
        assert r.tokens == x.tokens
        assert r.mass == [0.0] * NEW and not r.stopped
        assert r.counts[:, SUB].sum() == 0 and r.counts[:, 1].sum() > 0  # misses really fetched
        assert (r.steps["bytes_sync"] > 0).any()
        assert r.prompt_tokens == len(prompt) and r.wall_s.shape == (NEW,)


@pytest.mark.parametrize("name,policy", [("quality", QUALITY), ("speed", SPEED)])
def test_substituting_policy_generates_the_emulators_tokens(
    stage, exact, quality_engine, name, policy
):
    """Same policy, capacity and initial set: the engine's greedy tokens are the emulator's,
    token for token, and so is the substituted mass per token (float noise aside)."""
    root, model, initial = stage
    if name == "quality":
        eng, close = quality_engine, False
    else:
        eng = open_engine(
            root / "model", name, policy, FRACTION, "cpu", initial, params(root, admission="delay")
        )
        close = True
    try:
        res = eng.generate(PROMPTS, NEW)
    finally:
        if close:
            eng.close()
    if close:
        with pytest.raises(RuntimeError, match="closed"):
            eng.generate(PROMPTS, NEW)
    emu = greedy_decode(model, PROMPTS, Policy.from_dict(policy), C, initial, NEW)
    for r, x in zip(res, emu, strict=True):
        assert r.tokens == x.tokens
        np.testing.assert_allclose(r.mass, x.mass, rtol=0, atol=1e-5)
        assert (r.counts.sum(axis=1) == L * K).all()
    assert any(r.tokens != x.tokens for r, x in zip(res, exact, strict=True))  # policy mattered
    assert sum(r.admissions for r in res) > 0  # background admissions were copied and installed
    assert sum(int(r.steps["bytes_bg"].sum()) for r in res) > 0


def test_one_loop_serves_teacher_forcing(stage, quality_engine):
    """`decode` with no new tokens is the teacher-forced path of run_engine: per-token mass and
    NLL are the emulator's for the same stream (one loop for both modes)."""
    _root, model, initial = stage
    seq = np.random.default_rng(3).integers(3, VOCAB, 16)
    r = quality_engine.decode(seq)
    trace = emulate_stream(model, seq, Policy.from_dict(QUALITY), C, initial)
    assert r["generated"] == [] and r["wall_s"].shape == (16,)
    np.testing.assert_allclose(r["mass"], trace.mass.sum(axis=1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(r["nll"][1:], trace.nll[1:], rtol=0, atol=1e-4)
    assert r["mass"].sum() > 0
    with pytest.raises(ValueError, match="at least one input token"):
        quality_engine.decode([])


def test_stop_ids(quality_engine):
    eng = quality_engine
    (full,) = eng.generate(PROMPTS[1:2], NEW)
    assert not full.stopped and len(full.tokens) == NEW
    stop = full.tokens[3]
    first = full.tokens.index(stop)
    (cut,) = eng.generate(PROMPTS[1:2], NEW, stop_ids={stop, VOCAB + 5})
    assert cut.stopped and cut.tokens == full.tokens[:first] and len(cut.wall_s) == first
    assert cut.mass == full.mass[:first]  # every prompt starts from the initial set
    (none,) = eng.generate(PROMPTS[:1], 0)
    assert none.tokens == [] and none.mass == [] and none.wall_s.shape == (0,)


def test_bad_input(stage, quality_engine, monkeypatch):
    root, _model, initial = stage
    eng = quality_engine
    for bad, match in [
        ([[]], r"prompts\[0\] must be a non-empty"),
        ([[3, VOCAB]], r"prompts\[0\] holds token ids in \[3, 97\]"),
        ([[1.5]], "integer token ids"),
        ("abc", "list of token-id lists"),
    ]:
        with pytest.raises(ValueError, match=match):
            eng.generate(bad, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        eng.generate(PROMPTS, -1)
    with pytest.raises(ValueError, match="stop_ids must hold integer"):
        eng.generate(PROMPTS, 4, stop_ids=["x"])
    with pytest.raises(ValueError, match=r"\['fraction', 'policy'\] are fixed"):
        generate(eng, PROMPTS, 4, policy=QUALITY, fraction=0.5)
    # a model directory: every check runs before the model is loaded
    monkeypatch.setattr("moesub.models.load_model", lambda *a, **k: pytest.fail("loaded"))
    model_dir = root / "model"
    cases = [
        (dict(prompts=[[3, 500]]), "outside the model's vocabulary"),
        (dict(fraction=0.1), r"capacity C=\d+, outside \[k="),
        (dict(policy={"rule": "nope"}), "policy rule: unknown value 'nope'"),
        (dict(params=params(root, admission="soon")), "params.admission"),
        (dict(initial=initial[:, :5]), "initial: expected shape"),
        (dict(name=""), "non-empty policy name"),
        (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), "CUDA was requested"))
    for kw, match in cases:
        args = dict(
            prompts=PROMPTS, max_new_tokens=4, name="quality", policy=QUALITY,
            fraction=FRACTION, initial=initial, params=params(root),
        )  # fmt: skip
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            generate(model_dir, **args)
    with pytest.raises(FileNotFoundError, match="model_dir"):
        generate(root / "missing", PROMPTS, 4, name="x", policy=QUALITY, fraction=FRACTION)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "device",
    [
        pytest.param(
            f"cuda:{i}",
            marks=pytest.mark.skipif(torch.cuda.device_count() <= i, reason=f"needs {i + 1} GPUs"),
        )
        for i in range(2)
    ],
)
def test_cuda_generation_matches_the_emulator(stage, device):
    """Pinned->CUDA tier, admissions on the side stream at the core's delay: the emulator's
    tokens (the emulator also on the GPU in float32, so both see the same GPU rounding)."""
    import copy

    root, model, initial = stage
    with open_engine(
        root / "model", "speed", SPEED, FRACTION, device, initial,
        params(root, admission="delay", dtype="float32"),
    ) as eng:  # fmt: skip
        res = eng.generate(PROMPTS, NEW)
    emu = greedy_decode(
        copy.deepcopy(model).to(device), PROMPTS, Policy.from_dict(SPEED), C, initial, NEW
    )
    assert [r.tokens for r in res] == [x.tokens for x in emu]
    assert sum(int(r.steps["bytes_bg"].sum()) for r in res) > 0


@pytest.mark.parametrize(
    "name,policy",
    [
        ("quality_prefetch", {**QUALITY, "prefetch": 2}),
        ("fetch_prefetch", {"rule": "fetch_all", "prefetch": 3}),
        ("first_choice_host", {"rule": "first_choice", "light_miss": "host", "prefetch": 1}),
    ],
)
def test_prefetch_generation_equals_the_emulators(stage, name, policy):
    """v2 on the engine (lookahead computed one MoE layer early by the PrefetchHook, copies
    issued then, light_miss='host' on the worker thread), admission="delay": the emulator's
    greedy tokens and substituted mass, token for token; fetch_all with prefetch is still the
    exact model (prefetch changes what is resident, never what is computed)."""
    root, model, initial = stage
    with open_engine(
        root / "model", name, policy, FRACTION, "cpu", initial, params(root, admission="delay")
    ) as eng:
        res = eng.generate(PROMPTS, NEW)
    emu = greedy_decode(model, PROMPTS, Policy.from_dict(policy), C, initial, NEW)
    for r, x in zip(res, emu, strict=True):
        assert r.tokens == x.tokens
        np.testing.assert_allclose(r.mass, x.mass, rtol=0, atol=1e-5)
        assert r.steps["prefetch_in_time"].sum() <= r.steps["prefetches"].sum()
    assert sum(int(r.steps["prefetches"].sum()) for r in res) > 0  # copies were issued
    assert sum(int(r.steps["bytes_prefetch"].sum()) for r in res) > 0  # and installed
    if policy["rule"] == "fetch_all":
        exact = greedy_decode(model, PROMPTS, None, C, None, NEW)
        assert [r.tokens for r in res] == [x.tokens for x in exact]
    if policy.get("light_miss") == "host":
        assert sum(int(r.counts[:, HOST].sum()) for r in res) > 0
        assert sum(int(r.steps["bytes_host"].sum()) for r in res) > 0


@pytest.mark.parametrize(
    "name,policy",
    [
        ("cache_prior_quality", {**QUALITY, "route_bias": 0.1}),
        ("cache_prior_fetch_prefetch", {"rule": "fetch_all", "route_bias": 0.2, "prefetch": 2}),
        ("cache_prior_hybrid", {"rule": "threshold", "tau": 0.15, "light_miss": "host",
                                "route_bias": 0.1}),
    ],
)  # fmt: skip
def test_route_bias_on_the_engine_equals_the_emulator(stage, name, policy):
    """Cache-aware routing (route_bias): a row the core rerouted computes S's experts with the
    weights the model's router gives S, on the engine as in the emulator (one shared placement,
    `moesub.replay.place_ranked` / `rerouted_weights`). admission="delay": teacher forcing gives
    the emulator's per-token status counts exactly and its NLL and mass; greedy generation (the
    prompt prefilled) its tokens and mass, token for token. Rows really were rerouted."""
    root, model, initial = stage
    pol = Policy.from_dict(policy)
    seq = np.random.default_rng(11).integers(3, VOCAB, 20)
    trace = emulate_stream(model, seq, pol, C, initial, record=True)
    top = np.sort(np.argsort(-trace.logits, axis=-1, kind="stable")[..., :K], axis=-1)
    assert (top != np.sort(trace.selected, axis=-1)).any()  # the bias changed selections
    with open_engine(
        root / "model", name, policy, FRACTION, "cpu", initial, params(root, admission="delay")
    ) as eng:  # fmt: skip
        _r, res = engine_equals_emulator(eng, model, seq, trace, pol, initial)
    exact = greedy_decode(model, PROMPTS, None, C, None, NEW)
    assert any(g.tokens != x.tokens for g, x in zip(res, exact, strict=True))  # it mattered


def engine_equals_emulator(eng, model, seq, trace, pol, initial):
    """admission="delay": teacher forcing `seq` on the engine gives the emulator's `trace`
    (per-token status counts exactly, mass and NLL), greedy generation of PROMPTS its tokens and
    mass. Returns the engine's (decode result, generation results)."""
    r = eng.decode(seq)
    res = eng.generate(PROMPTS, NEW)
    assert np.array_equal(r["counts"], trace.counts)
    np.testing.assert_allclose(r["mass"], trace.mass.sum(axis=1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(r["nll"][1:], trace.nll[1:], rtol=0, atol=1e-4)
    emu = greedy_decode(model, PROMPTS, pol, C, initial, NEW)
    for g, x in zip(res, emu, strict=True):
        assert g.tokens == x.tokens
        np.testing.assert_allclose(g.mass, x.mass, rtol=0, atol=1e-5)
    return r, res


@pytest.mark.parametrize("admission", ["delay", "completion"])
def test_prefill_equals_stepping_the_prompt(stage, admission):
    """A prompt prefilled in one forward (its rows through the cores one at a time, experts from
    the slow tier, slots reloaded, pending admissions requested) continues exactly as the
    prompt fed token by token: same NLL over the prompt, same tokens and mass after it."""
    root, _model, initial = stage
    seq = np.random.default_rng(5).integers(3, VOCAB, 24)
    with open_engine(
        root / "model", "quality", QUALITY, FRACTION, "cpu", initial,
        params(root, admission=admission),
    ) as eng:  # fmt: skip
        stepped = eng.decode(seq, max_new_tokens=8)
        prefilled = eng.decode(seq, max_new_tokens=8, prefill=True)
    np.testing.assert_allclose(prefilled["nll"][1:], stepped["nll"][1:], rtol=0, atol=1e-4)
    if admission == "delay":  # with "completion" copies land when they land
        assert prefilled["generated"] == stepped["generated"]
        np.testing.assert_allclose(prefilled["mass"][23:], stepped["mass"][23:], atol=1e-5)
    assert (prefilled["wall_s"][1:23] == 0).all() and prefilled["wall_s"][0] > 0


def test_generate_stage_on_the_engine_and_the_emulator(tmp_path):
    """The generate stage decodes on the engine by default: the rows carry time per generated
    token (and the blocked times), the metadata the tier; under admission="delay" its tokens are
    the emulator backend's (whose timing columns are null)."""
    import polars as pl
    from test_generate import gsm8k_file, tiny_checkpoint

    from moesub.generate import run_generate
    from moesub.io import read_metadata

    root = tiny_checkpoint(tmp_path)
    gsm8k_file(root / "gsm8k.jsonl", 40)
    tables = {}
    for backend in ("engine", "emulator"):
        out = run_generate(
            root / "model", "gsm8k", root / "gsm8k.jsonl", root / "ranking.parquet",
            "speed", SPEED, 0.375, tmp_path / f"{backend}.parquet",
            {"n": 3, "max_new_tokens": 8, "progress": False, "backend": backend},
            {"store_path": str(tmp_path / "experts.bin")},
        )  # fmt: skip
        tables[backend] = (pl.read_parquet(out), read_metadata(out))
    eng, meta = tables["engine"]
    emu, emeta = tables["emulator"]
    assert eng["tokens"].to_list() == emu["tokens"].to_list()
    assert eng["correct"].to_list() == emu["correct"].to_list()
    assert (eng["time_per_token_s"] > 0).all() and (eng["fetch_wait_s"] >= 0).all()
    assert emu["time_per_token_s"].is_null().all()
    assert meta["backend"] == "engine" and meta["admission"] == "delay" and "tier" in meta
    assert meta["time_per_token_median_s"] > 0 and emeta["time_per_token_median_s"] is None
    with pytest.raises(ValueError, match="backend"):
        run_generate(
            root / "model", "gsm8k", root / "gsm8k.jsonl", root / "ranking.parquet",
            "speed", SPEED, 0.375, tmp_path / "x.parquet", {"backend": "gpu"},
        )  # fmt: skip
