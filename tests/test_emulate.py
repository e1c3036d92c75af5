"""moesub.emulate: exactness of layer-major emulation, the token-by-token oracle, greedy decoding,
the stage entry point and its input checks. Tiny random Qwen3-Next model (E=16, k=4, C=6)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from fixtures_artefacts import write_ranking
from tiny_models import tiny_qwen3_next

from moesub.artefacts import load_trace, read_expert_ranking
from moesub.capture import run_capture
from moesub.emulate import (
    EmulateParams,
    emulate_stream,
    emulate_streams,
    emulate_token_by_token,
    run_emulate,
    summarize,
)
from moesub.greedy import greedy_decode
from moesub.io import read_metadata, write_parquet
from moesub.models import stream_batches, stream_nll
from moesub.policy import FETCH, STATUS_NAMES, SUB, Policy, scan
from moesub.replay import computed_ids
from moesub.simulate import run_simulate
from moesub.slots import pin_count

VOCAB, E, K, L, C = 97, 16, 4, 4, 6
SUBSTITUTING = Policy(rule="threshold", tau=0.15, eviction="lfu", beta=0.5)


def tiny_model(seed: int = 0):
    return tiny_qwen3_next(vocab=VOCAB, layers=L, experts=E, k=K, expert_std=0.4, seed=seed)


def token_table(lengths: list[int], seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    frames = []
    for s, n in enumerate(lengths):
        doc = np.repeat(np.arange(3), -(-n // 3))[:n] + 10 * s
        frames.append(
            pl.DataFrame(
                {
                    "stream": np.full(n, s, np.int32),
                    "pos": np.arange(n, dtype=np.int32),
                    "token_id": rng.integers(3, VOCAB, n).astype(np.int32),
                    "doc_id": doc.astype(np.int32),
                    "doc_start": np.r_[True, doc[1:] != doc[:-1]],
                }
            )
        )
    return pl.concat(frames)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def initial():
    rng = np.random.default_rng(1)
    return np.stack([rng.permutation(E)[:C] for _ in range(L)]).astype(np.int32)


def exact_nll(model, tokens: pl.DataFrame) -> np.ndarray:
    out = []
    for _, rows in tokens.group_by("stream", maintain_order=True):
        ids = torch.as_tensor(rows["token_id"].to_numpy().astype(np.int64))[None]
        out.append(stream_nll(model, ids)[0])
    return np.concatenate(out)


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("rule", ["fetch_all", "host_compute"])
def test_exact_policies_reproduce_captured_nll_bit_for_bit(model, initial, rule):
    tokens = token_table([40, 33])
    out = emulate_streams(model, tokens, Policy(rule=rule), C, initial, progress=False)
    assert out.columns == [
        "stream", "pos", "doc_id", "doc_start", "nll", "mass", "layer_mass", *STATUS_NAMES,
        "prefetches",
    ]  # fmt: skip
    assert (out["prefetches"] == 0).all()  # no prefetch policy
    ref = exact_nll(model, tokens)
    got = out["nll"].fill_null(np.nan).to_numpy()
    assert np.array_equal(got, ref, equal_nan=True)  # bit-identical, not merely close
    assert out["nll"].null_count() == 2  # pos 0 of each stream
    assert (out["mass"] == 0).all() and (out["sub"] == 0).all() and (out["forced"] == 0).all()
    slots = out.select(pl.sum_horizontal(STATUS_NAMES)).to_series()
    assert (slots == L * K).all()
    if rule == "host_compute":
        assert out["fetch"].sum() == 0 and out["host"].sum() > 0
    else:
        assert out["host"].sum() == 0 and out["fetch"].sum() > 0


def test_layer_major_equals_token_by_token_under_substitution_with_admission(model, initial):
    ids = token_table([64], seed=3)["token_id"].to_numpy()
    fast = emulate_stream(model, ids, SUBSTITUTING, C, initial, record=True)
    slow = emulate_token_by_token(model, ids, SUBSTITUTING, C, initial)
    assert fast.ids.shape == (64, L, K)
    np.testing.assert_array_equal(fast.selected, slow.selected)
    np.testing.assert_array_equal(fast.status, slow.status)
    np.testing.assert_array_equal(fast.ids, slow.ids)
    np.testing.assert_allclose(fast.mass, slow.mass, atol=1e-5)  # logits differ by float noise
    np.testing.assert_allclose(fast.nll, slow.nll, atol=1e-5, equal_nan=True)
    assert fast.admissions == slow.admissions > 0
    assert (fast.status == SUB).sum() > 20 and (fast.status == FETCH).any()

    # The test is sensitive: substitution changed what later layers route on, so replaying the
    # exact model's router logits through the core (what the simulator does) gives other ids.
    logits = []
    from moesub.models import RouterHook

    with RouterHook(model, lambda layer, z, w, i: logits.append((layer, z.numpy().copy()))):
        stream_nll(model, torch.as_tensor(ids.astype(np.int64))[None])
    trace = np.stack([z for _, z in sorted(logits, key=lambda x: x[0])], axis=1)  # (T, L, E)
    replay = scan(trace, K, C, SUBSTITUTING, initial)
    np.testing.assert_array_equal(replay.selected[:, 0], fast.selected[:, 0])  # layer 0 agrees
    assert not np.array_equal(replay.selected[:, 1:], fast.selected[:, 1:])
    assert np.nanmax(np.abs(fast.nll - exact_nll(model, token_table([64], seed=3)))) > 1e-3


def test_stream_batches_groups_consecutive_equal_lengths():
    assert stream_batches([40, 40, 40, 33, 33], 80) == [[0, 1], [2], [3, 4]]
    assert stream_batches([40, 40, 40], None) == [[0], [1], [2]]
    assert stream_batches([40, 40], 10) == [[0], [1]]  # a stream longer than the budget: alone
    assert stream_batches([5, 7, 5], 1000) == [[0], [1], [2]]  # only consecutive equal lengths
    with pytest.raises(ValueError, match="batch_tokens"):
        stream_batches([4], 0)


def test_batched_streams_make_the_same_decisions_as_one_stream_per_forward(model, initial):
    tokens = token_table([40, 40, 40, 33], seed=11)
    one = emulate_streams(model, tokens, SUBSTITUTING, C, initial, progress=False)
    batched = emulate_streams(
        model, tokens, SUBSTITUTING, C, initial, progress=False, batch_tokens=80
    )  # forwards: streams [0, 1], [2], [3]
    keys = ["stream", "pos", "doc_id", "doc_start", *STATUS_NAMES]
    assert batched.select(keys).equals(one.select(keys))
    assert batched["sub"].sum() > 0
    for col in ("nll", "mass"):  # batched matmuls may round differently
        a, b = (df[col].fill_null(np.nan).to_numpy() for df in (batched, one))
        np.testing.assert_allclose(a, b, atol=1e-5, equal_nan=True)


def test_emulated_counts_and_mass_match_the_trace(model, initial):
    tokens = token_table([50], seed=5)
    out = emulate_streams(model, tokens, SUBSTITUTING, C, initial, progress=False)
    trace = emulate_stream(model, tokens["token_id"].to_numpy(), SUBSTITUTING, C, initial, True)
    for code, name in enumerate(STATUS_NAMES):
        np.testing.assert_array_equal(out[name].to_numpy(), (trace.status == code).sum((1, 2)))
    layer_mass = np.stack(out["layer_mass"].to_list())
    np.testing.assert_array_equal(layer_mass, trace.mass)
    np.testing.assert_allclose(out["mass"].to_numpy(), trace.mass.sum(1))
    assert out["sub"].sum() > 0


# --------------------------------------------------------------------------- greedy decoding
def test_greedy_decode_exact_matches_generate(model):
    prompts = [[5, 17, 33, 8], [40, 41]]
    exact = greedy_decode(model, prompts, None, C, None, max_new_tokens=10)
    fetch = greedy_decode(model, prompts, Policy(), C, None, max_new_tokens=10)
    for prompt, a, b in zip(prompts, exact, fetch, strict=True):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10
        )[0, len(prompt) :].tolist()
        assert a.tokens == ref == b.tokens
        assert b.mass == [0.0] * 10 and not a.stopped


def test_greedy_decode_under_policy_matches_teacher_forced_emulation(model, initial):
    prompt = [7, 21, 50, 3, 64, 12]
    (res,) = greedy_decode(model, [prompt], SUBSTITUTING, C, initial, max_new_tokens=12)
    assert len(res.tokens) == 12 and sum(res.mass) > 0
    seq = np.array(prompt + res.tokens)
    trace = emulate_stream(model, seq, SUBSTITUTING, C, initial)
    # token i was produced by the forward at position len(prompt) - 1 + i
    rows = np.arange(len(prompt) - 1, len(seq) - 1)
    np.testing.assert_allclose(res.mass, trace.mass.sum(1)[rows], atol=1e-5)  # float noise
    # greedy under the policy: every generated token had a finite NLL in the emulation
    assert np.isfinite(trace.nll[len(prompt) :]).all()
    stop = greedy_decode(model, [prompt], SUBSTITUTING, C, initial, 12, {res.tokens[3]})[0]
    assert stop.stopped and stop.tokens == res.tokens[:3]


# --------------------------------------------------------------------------- stage entry point
@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory, model, initial):
    root = tmp_path_factory.mktemp("emulate")
    model.save_pretrained(root / "model")
    write_parquet(token_table([30, 30], seed=7), root / "streams.parquet")
    run_capture(
        root / "model", root / "streams.parquet", root / "tokens.parquet",
        root / "router.parquet", {"name": "tiny"},
    )  # fmt: skip
    write_ranking(root / "ranking.parquet", initial, E)  # fraction 0.375: C = 6 = the prefix
    return root


def test_run_emulate_writes_table_and_metadata(stage_inputs, model, initial):
    root = stage_inputs
    pol = {"rule": "threshold", "tau": 0.15, "eviction": "lfu", "beta": 0.5, "delay": 1}
    out = run_emulate(
        root / "model", root / "tokens.parquet", root / "ranking.parquet", "quality", pol,
        0.375, root / "out" / "quality.parquet", {"progress": False},
    )  # fmt: skip
    df = pl.read_parquet(out)
    assert df.height == 60 and df["layer_mass"].list.len().unique().to_list() == [L]
    meta = read_metadata(out)
    assert meta["name"] == "quality" and meta["capacity"] == C and meta["fraction"] == 0.375
    assert meta["policy"] == pol and len(meta["core_build_id"]) > 0
    tokens = pl.read_parquet(root / "tokens.parquet")
    batch_tokens = read_metadata(root / "tokens.parquet")["batch_tokens"]
    ref = emulate_streams(
        model, tokens, SUBSTITUTING, C, initial, progress=False, batch_tokens=batch_tokens
    )
    assert df.equals(ref)

    base = run_emulate(
        root / "model", root / "tokens.parquet", root / "ranking.parquet",
        "fetch_every_miss", {"rule": "fetch_all"}, 0.375, root / "out" / "fem.parquet",
        {"progress": False},
    )  # fmt: skip
    summary = summarize({"fetch_every_miss": base, "quality": out})
    row = summary.filter(pl.col("policy") == "fetch_every_miss").row(0, named=True)
    assert row["dppl_pct"] == 0.0 and row["sub_rate"] == 0.0 and row["mass_mean"] == 0.0
    q = summary.filter(pl.col("policy") == "quality").row(0, named=True)
    assert q["sub_rate"] > 0 and q["dppl_pct"] != 0.0


def test_fetch_every_miss_reproduces_run_capture_nll(stage_inputs):
    root = stage_inputs
    out = _run(root, out_path=root / "out" / "fem_capture.parquet")
    got = pl.read_parquet(out)
    captured = pl.read_parquet(root / "tokens.parquet")
    assert got["nll"].null_count() == captured["nll"].null_count() == 2
    a = got["nll"].fill_null(np.nan).to_numpy()
    b = captured["nll"].fill_null(np.nan).to_numpy()
    assert np.array_equal(a, b, equal_nan=True)
    assert got.select("stream", "pos", "doc_id", "doc_start").equals(
        captured.select("stream", "pos", "doc_id", "doc_start")
    )


@pytest.mark.parametrize(
    "policy",
    [
        {"rule": "fetch_all", "eviction": "lru"},
        {"rule": "fetch_all", "eviction": "lru", "pin": "25%"},  # pins 1, 2, 1, 1
        {"rule": "host_compute", "eviction": "lru", "host_admit": 2, "pin": 1},
    ],
)
def test_per_layer_capacities_reproduce_the_capture(stage_inputs, tmp_path, policy):
    """A planned layout (per-layer capacities 5, 8, 5, 6; sum L x C = 24) under a lossless
    policy, with pins and host uploads, still computes the captured model bit for bit, and each
    layer's cache holds its own capacity, ranking prefix and pins: the per-token counts are
    those of one scan per layer at C_l over the captured router logits."""
    root = stage_inputs
    caps = [5, 8, 5, 6]
    (tmp_path / "alloc.json").write_text(json.dumps({"capacity": C, "capacities": caps}))
    planned = {**policy, "allocation": "planned"}
    out = _run(
        root, policy=planned, out_path=tmp_path / "planned.parquet",
        allocation_path=tmp_path / "alloc.json",
    )  # fmt: skip
    got = pl.read_parquet(out)
    captured = pl.read_parquet(root / "tokens.parquet")
    a, b = (df["nll"].fill_null(np.nan).to_numpy() for df in (got, captured))
    assert np.array_equal(a, b, equal_nan=True)
    layout = read_metadata(out)["layout"]
    pins = [pin_count(policy.get("pin", 0), c, K) for c in caps]
    assert layout["capacities"] == caps and layout["pins"] == pins
    trace = load_trace(root / "router.parquet")
    ranking = read_expert_ranking(root / "ranking.parquet", L, E)
    fields = {k: v for k, v in policy.items() if k != "pin"}
    hits = []
    for z in trace.logits:  # streams in id order, as the token table
        per_layer = [
            scan(
                z[:, [layer]], K, c, Policy(**fields, pin=pin), initial=ranking[None, layer, :c]
            ).status
            for layer, (c, pin) in enumerate(zip(caps, pins, strict=True))
        ]
        hits.append((np.concatenate(per_layer, axis=1) == 0).sum(axis=(1, 2)))
    np.testing.assert_array_equal(got["hit"].to_numpy(), np.concatenate(hits))
    uniform = pl.read_parquet(_run(root, policy=policy, out_path=tmp_path / "uniform.parquet"))
    assert not got["hit"].equals(uniform["hit"])  # the capacities differ from uniform C = 6
    with pytest.raises(ValueError, match="planned per-layer capacities"):
        _run(root, policy=planned, out_path=tmp_path / "x.parquet")


@pytest.mark.parametrize(
    "policy",
    [
        {"rule": "fetch_all", "prefetch": 2},
        {"rule": "threshold", "tau": 0.3, "eviction": "lfu", "light_miss": "host", "prefetch": 3},
    ],
)
def test_emulate_counts_prefetches_as_the_simulator(stage_inputs, tmp_path, policy):
    """A lossless prefetching policy computes the captured model exactly, so its emulation sees
    the captured router and lookahead logits and makes the simulator's decisions: emulate's
    `prefetches` (per token, summed over layers) and status counts add up to the simulator's
    total row on the same trace."""
    root = stage_inputs
    emu = pl.read_parquet(_run(root, policy=policy, out_path=tmp_path / "emu.parquet"))
    run_simulate(
        str(root / "router.parquet"), str(root / "ranking.parquet"), "p", policy, 0.375,
        str(tmp_path / "sim.parquet"), str(tmp_path / "sim.counts.parquet"),
    )  # fmt: skip
    total = (
        pl.read_parquet(tmp_path / "sim.parquet").filter(pl.col("layer") == -1).row(0, named=True)
    )
    assert emu["prefetches"].dtype == pl.Int32 and total["prefetches"] > 0
    for col in ("prefetches", *STATUS_NAMES):
        assert emu[col].sum() == total[col], col
    summary = summarize({"p": tmp_path / "emu.parquet"})
    assert summary["prefetches"][0] == total["prefetches"]


def _run(root, **over):
    args = dict(
        model_dir=root / "model", tokens_path=root / "tokens.parquet",
        ranking_path=root / "ranking.parquet", name="p",
        policy={"rule": "fetch_all"}, size=0.375, out_path=root / "bad" / "x.parquet",
        params={"progress": False},
    )  # fmt: skip
    args.update(over)
    return run_emulate(**args)


def test_run_emulate_rejects_bad_input(stage_inputs):
    root = stage_inputs
    with pytest.raises(ValueError, match="policy"):
        _run(root, policy={"rule": "fetch_sometimes"})
    with pytest.raises(ValueError, match="policy"):
        _run(root, policy={"rule": "threshold", "tua": 0.1})
    with pytest.raises(ValueError, match="fraction"):
        _run(root, size=1.5)
    with pytest.raises(FileNotFoundError, match="tokens_path"):
        _run(root, tokens_path=root / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="ranking_path"):
        _run(root, ranking_path=root / "nope.parquet")
    with pytest.raises(ValueError, match="params"):
        _run(root, params={"batch": 3})

    big = pl.read_parquet(root / "tokens.parquet").with_columns(
        token_id=pl.when(pl.col("pos") == 5).then(VOCAB + 3).otherwise(pl.col("token_id"))
    )
    write_parquet(big, root / "big.parquet")
    with pytest.raises(ValueError, match="vocabulary"):
        _run(root, tokens_path=root / "big.parquet")

    # a ranking written for another model (5 layers, E=32)
    write_ranking(root / "other_ranking.parquet", np.tile(np.arange(C) + 20, (5, 1)), 32)
    with pytest.raises(ValueError, match="expert ranking"):
        _run(root, ranking_path=root / "other_ranking.parquet")

    # a capture of another model (the token table records E/k/L of the model that made it)
    tokens = pl.read_parquet(root / "tokens.parquet")
    write_parquet(tokens, root / "other_tokens.parquet", {"num_experts": 32, "top_k": K})
    with pytest.raises(ValueError, match="num_experts"):
        _run(root, tokens_path=root / "other_tokens.parquet")
    assert not (root / "bad" / "x.parquet").exists()


def test_token_table_and_params_checks(model):
    bad = token_table([10]).filter(pl.col("pos") != 4)
    with pytest.raises(ValueError, match="positions"):
        emulate_streams(model, bad, Policy(), C, None, progress=False)
    with pytest.raises(ValueError, match="lacks"):
        emulate_streams(model, token_table([10]).drop("doc_id"), Policy(), C, None)
    with pytest.raises(ValueError, match="shape"):
        emulate_streams(model, token_table([10]), Policy(), C, np.zeros((L, C + 1), np.int32))
    assert EmulateParams.from_dict(None) == EmulateParams()
    with pytest.raises(ValueError, match="max_streams"):
        EmulateParams.from_dict({"max_streams": 0})
    host = emulate_streams(model, token_table([12]), Policy(rule="host_compute"), C, None, False)
    assert host["host"].sum() + host["hit"].sum() == 12 * L * K


def test_computed_ids_paths():
    sel = np.array([[3, 1, 7], [2, 5, 0]], np.int32)
    comp = np.array([[3, 9, 7], [2, 5, 0]], np.int32)
    logits = torch.zeros(2, 10)
    assert computed_ids(torch.as_tensor(sel, dtype=torch.long), sel, sel, logits) is None
    same = computed_ids(torch.as_tensor(sel, dtype=torch.long), sel, comp, logits)
    assert same.dtype == torch.long and same.tolist() == comp.tolist()
    model_order = torch.tensor([[7, 3, 1], [0, 2, 5]])  # another slot order: mapped by expert
    assert computed_ids(model_order, sel, comp, logits).tolist() == [[7, 3, 9], [0, 2, 5]]
