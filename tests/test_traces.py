"""moesub.traces: the formats byte for byte, the probability/zero/incomplete conventions, the
chunked simulation against the whole-stream scan, and bad input."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from moesub.artefacts import Trace, frequency_sets, router_rows, router_writer, selection_counts
from moesub.grid import COUNTER_NAMES, GridPoint, simulate
from moesub.policy import STATUS_NAMES, Policy, capacity_for, scan
from moesub.synthetic import synthetic_logits
from moesub.traces import (
    ZERO_LOGIT,
    TraceFormatError,
    TraceWriter,
    detect_format,
    frequency_order,
    open_trace,
    rank_logits,
    ranked_topk,
    read_pin_list,
    read_trace,
    simulate_trace,
    write_pin_list,
    write_trace,
)
from moesub.traces.base import probabilities_to_logits, softmax_probabilities

T, L, E, K = 240, 3, 32, 4


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return synthetic_logits(T, L, E, seed=7)  # (T, L, E)


def raw_rtrace(path, E: int, records, version: int = 0, magic: bytes = b"RTRACE01") -> None:
    """An RTRACE01 file from (token, layer, probs) records, written with struct alone."""
    with open(path, "wb") as f:
        f.write(magic + struct.pack("<ii", E, version))
        for t, l, p in records:
            f.write(struct.pack("<ii", t, l) + np.asarray(p, "<f4").tobytes())


def records_of(probs: np.ndarray):
    return [(t, l, probs[t, l]) for t in range(probs.shape[0]) for l in range(probs.shape[1])]


def no_temp_files(directory) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------
# RTRACE01


def test_rtrace01_bytes_are_the_format(tmp_path, logits):
    path = write_trace(tmp_path / "t.rtrace01", "rtrace01", logits=logits)
    raw = path.read_bytes()
    assert raw[:8] == b"RTRACE01" and struct.unpack_from("<ii", raw, 8) == (E, 0)
    rs = 8 + 4 * E
    assert len(raw) == 16 + T * L * rs
    probs = softmax_probabilities(logits)
    for i in (0, 1, L, T * L - 1):  # token-major records
        t, l = struct.unpack_from("<ii", raw, 16 + i * rs)
        assert (t, l) == divmod(i, L)
        got = np.frombuffer(raw, "<f4", E, 16 + i * rs + 8)
        np.testing.assert_array_equal(got, probs[t, l])
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_rtrace01_read_back(tmp_path, logits):
    path = write_trace(tmp_path / "t.rtrace01", "rtrace01", logits=logits)
    assert detect_format(path) == "rtrace01"
    tr = read_trace(path, top_k=K)
    assert (tr.format, tr.num_experts, tr.top_k, tr.num_layers) == ("rtrace01", E, K, L)
    assert tr.layers == (0, 1, 2) and tr.streams == (T,) and tr.dropped_tokens == 0
    # logits are the logarithms of the stored probabilities: same selection as the source
    np.testing.assert_array_equal(tr.logits, np.log(softmax_probabilities(logits)))
    np.testing.assert_array_equal(tr.ids, scan(logits, K, K, Policy()).selected)
    np.testing.assert_array_equal(tr.ids, scan(tr.logits, K, K, Policy()).selected)
    # normalized gate weights agree with the source's up to float32 rounding
    w_src = scan(logits, K, 8, Policy()).weights
    np.testing.assert_allclose(scan(tr.logits, K, 8, Policy()).weights, w_src, rtol=2e-6)


def test_rtrace01_any_record_order(tmp_path, logits):
    """llama.cpp writes each micro-batch layer by layer: any record order reads the same."""
    probs = softmax_probabilities(logits)
    recs = records_of(probs)
    ubatch = [(t, l, probs[t, l]) for u in range(0, T, 64) for l in range(L)
              for t in range(u, min(u + 64, T))]  # fmt: skip
    raw_rtrace(tmp_path / "a.bin", E, recs)
    raw_rtrace(tmp_path / "b.bin", E, ubatch)
    a, b = read_trace(tmp_path / "a.bin", top_k=K), read_trace(tmp_path / "b.bin", top_k=K)
    np.testing.assert_array_equal(a.logits, b.logits)
    np.testing.assert_array_equal(a.ids, b.ids)
    rng = np.random.default_rng(0)
    raw_rtrace(tmp_path / "c.bin", E, [recs[i] for i in rng.permutation(len(recs))])
    grid = [GridPoint.at_fraction("fem", Policy(), 0.25, E)]
    np.testing.assert_array_equal(
        simulate_trace(open_trace(tmp_path / "c.bin", top_k=K), grid, chunk_tokens=13)["hit"],
        simulate_trace(a, grid)["hit"],
    )


def test_zero_probabilities_rank_last_with_no_weight(tmp_path):
    probs = np.zeros((2, 1, 8), np.float32)
    probs[0, 0, [5, 2]] = [0.75, 0.25]  # two positive, six zero: k=4 selects two zeros
    probs[1, 0] = np.float32(1 / 8)
    raw_rtrace(tmp_path / "z.bin", 8, records_of(probs))
    tr = read_trace(tmp_path / "z.bin", top_k=4)
    assert tr.logits[0, 0, 0] == ZERO_LOGIT and np.isfinite(tr.logits).all()
    assert tr.ids[0, 0].tolist() == [5, 2, 0, 1]  # positives by probability, zeros by id
    assert tr.ids[1, 0].tolist() == [0, 1, 2, 3]  # equal probabilities: ties to the lower id
    r = scan(tr.logits, 4, 4, Policy())
    np.testing.assert_array_equal(r.selected, tr.ids)
    np.testing.assert_allclose(r.weights[0, 0, :2], [0.75, 0.25], rtol=1e-6)
    assert r.weights[0, 0, 2:].max() < 1e-40
    # every positive float32 maps above the floor
    tiny = np.array([np.float32(1e-45), np.finfo(np.float32).tiny, 0.0], np.float32)
    z = probabilities_to_logits(tiny)
    assert z[0] > ZERO_LOGIT and z[1] > z[0] and z[2] == ZERO_LOGIT


def test_incomplete_records_layers_and_gaps(tmp_path):
    probs = softmax_probabilities(synthetic_logits(6, 3, 8, seed=1))
    recs = records_of(probs)
    raw_rtrace(tmp_path / "inc.bin", 8, [r for r in recs if r[:2] != (4, 1)])
    with pytest.raises(TraceFormatError, match=r"incomplete: token 4 has no record for layer 1"):
        open_trace(tmp_path / "inc.bin", top_k=2)
    tr = read_trace(tmp_path / "inc.bin", top_k=2, incomplete="drop")
    assert tr.num_tokens == 5 and tr.dropped_tokens == 1
    np.testing.assert_array_equal(tr.logits, np.log(probs[[0, 1, 2, 3, 5]]))
    # a layer no record mentions is not an MoE layer: left out, the numbering kept
    raw_rtrace(tmp_path / "hyb.bin", 8, [r for r in recs if r[1] != 1])
    tr = read_trace(tmp_path / "hyb.bin", top_k=2)
    assert tr.layers == (0, 2)
    np.testing.assert_array_equal(tr.logits, np.log(probs[:, [0, 2]]))
    # a token with no record at any layer is a gap, whatever `incomplete` says
    raw_rtrace(tmp_path / "gap.bin", 8, [r for r in recs if r[0] != 3])
    for mode in ("error", "drop"):
        with pytest.raises(TraceFormatError, match="token gap: no record for token 3"):
            open_trace(tmp_path / "gap.bin", top_k=2, incomplete=mode)
    raw_rtrace(tmp_path / "dup.bin", 8, [*recs, recs[4]])
    with pytest.raises(TraceFormatError, match=r"record 18 \(offset 736\): a second record for "
                       r"token 1, layer 1 \(the first is at record 4"):  # fmt: skip
        open_trace(tmp_path / "dup.bin", top_k=2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda b: b[:-5], r"offset 1176: truncated: the last record has 35 of its 40 bytes"),
        (lambda b: b[:10], r"truncated: 10 bytes, the header alone is 16"),
        (lambda b: b"RTRACE02" + b[8:], r"offset 0: wrong magic b'RTRACE02'"),
        (lambda b: b[:12] + struct.pack("<i", 1) + b[16:], r"offset 12: header version 1"),
        (lambda b: b[:8] + struct.pack("<i", 0) + b[12:], r"offset 8: n_experts 0"),
        (lambda b: b[:8] + struct.pack("<i", 9) + b[12:], r"truncated: the last record"),
    ],
)
def test_bad_rtrace01_structure(tmp_path, edit, message):
    probs = softmax_probabilities(synthetic_logits(10, 3, 8, seed=2))
    raw_rtrace(tmp_path / "ok.bin", 8, records_of(probs))
    bad = tmp_path / "bad.bin"
    bad.write_bytes(edit((tmp_path / "ok.bin").read_bytes()))
    with pytest.raises(TraceFormatError, match=message) as e:
        open_trace(bad, "rtrace01", top_k=2)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.nan, "NaN probability at expert 3"),
        (-0.01, "negative probability -0.0099.* at expert 3"),
        (np.inf, "infinite probability at expert 3"),
        (None, "every probability is 0"),
    ],
)
def test_bad_probabilities_named_with_their_record(tmp_path, value, message):
    probs = softmax_probabilities(synthetic_logits(10, 3, 8, seed=2))
    if value is None:
        probs[9, 2] = 0
    else:
        probs[9, 2, 3] = value
    raw_rtrace(tmp_path / "p.bin", 8, records_of(probs))
    # the last record: found by the checking pass, before any simulation
    with pytest.raises(TraceFormatError, match=rf"record 29 \(offset 1176\): {message}"):
        open_trace(tmp_path / "p.bin", top_k=2)


def test_rtrace01_needs_top_k_and_consistent_sizes(tmp_path, logits):
    path = write_trace(tmp_path / "t.rtrace01", "rtrace01", logits=logits)
    with pytest.raises(ValueError, match="does not record the model's top-k"):
        read_trace(path)
    with pytest.raises(ValueError, match=r"top_k: 40 is not in \[1, n_experts=32\]"):
        read_trace(path, top_k=40)
    with pytest.raises(TraceFormatError, match="n_experts 32, but num_experts=64"):
        read_trace(path, top_k=K, num_experts=64)
    with pytest.raises(TraceFormatError, match="wrong magic"):
        read_trace(path, "mblt")


# ---------------------------------------------------------------------------------------------
# MBLT


def mblt_file(path, E: int, records, version: int = 1) -> None:
    words = [0x544C424D, version, E]
    for layer, rows in records:
        rows = np.asarray(rows)
        words += [layer, rows.shape[1], rows.shape[0], *rows.reshape(-1).tolist()]
    np.array(words, "<i4").tofile(path)


def test_mblt_bytes_and_read_back(tmp_path, logits):
    ids = ranked_topk(logits, K)
    path = write_trace(tmp_path / "t.mblt", "mblt", ids=ids, num_experts=E)
    words = np.fromfile(path, "<i4")
    assert words[:3].tolist() == [0x544C424D, 1, E] and path.read_bytes()[:4] == b"MBLT"
    rec = words[3:].reshape(T, L, 3 + K)
    assert (rec[:, :, 0] == np.arange(L)).all() and (rec[:, :, 1:3] == [K, 1]).all()
    np.testing.assert_array_equal(rec[:, :, 3:], ids)
    assert detect_format(path) == "mblt"
    tr = read_trace(path)
    assert (tr.logits, tr.num_experts, tr.top_k, tr.layers) == (None, E, K, (0, 1, 2))
    np.testing.assert_array_equal(tr.ids, ids)
    from_logits = write_trace(tmp_path / "u.mblt", "mblt", logits=logits, top_k=K)
    assert from_logits.read_bytes() == path.read_bytes()


def test_mblt_prefill_pass(tmp_path):
    """A prefill pass of 5 tokens whose last layer routes only the last token, then 2 decodes."""
    rng = np.random.default_rng(3)
    rows = [rng.permutation(16)[:2] for _ in range(5 * 3 + 2 * 3)]
    pre = [(0, rows[0:5]), (1, rows[5:10]), (2, [rows[10]])]
    dec = [(0, [rows[15]]), (1, [rows[16]]), (2, [rows[17]]), (0, [rows[18]]), (1, [rows[19]]),
           (2, [rows[20]])]  # fmt: skip
    mblt_file(tmp_path / "p.mblt", 16, pre + dec)
    with pytest.raises(TraceFormatError, match="incomplete: token 0 has no record for layer 2"):
        read_trace(tmp_path / "p.mblt")
    tr = read_trace(tmp_path / "p.mblt", incomplete="drop")
    assert tr.num_tokens == 3 and tr.dropped_tokens == 4
    np.testing.assert_array_equal(tr.ids[0], [rows[4], rows[9], rows[10]])  # the last prompt token
    np.testing.assert_array_equal(tr.ids[2], [rows[18], rows[19], rows[20]])


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w[:-1], r"offset 72: truncated: the record needs 2 ids, 1 int32 remain"),
        (lambda w: w[:5], r"offset 12: truncated: a record header needs 3 int32, 2 remain"),
        (lambda w: np.r_[0x4D424C54, w[1:]], r"offset 0: wrong magic 0x4d424c54"),
        (lambda w: np.r_[w[:1], 2, w[2:]], r"offset 4: version 2, expected 1"),
        (
            lambda w: np.r_[w[:8], [1, 3, 1, 1, 2, 3]],
            "offset 32: inconsistent k: this record has k 3",
        ),
        (lambda w: np.r_[w[:3], [0, 2, 1, 1, 9]], r"expert ids \[1, 9\] outside \[0, n_expert=8\)"),
        (lambda w: np.r_[w[:3], [0, 2, 1, 4, 4]], r"expert ids \[4, 4\] repeat an expert"),
    ],
)
def test_bad_mblt(tmp_path, mutate, message):
    mblt_file(tmp_path / "ok.mblt", 8, [(0, [[1, 2]]), (1, [[3, 4]]), (0, [[5, 6]]), (1, [[0, 7]])])
    words = np.fromfile(tmp_path / "ok.mblt", "<i4")
    np.asarray(mutate(words), "<i4").tofile(tmp_path / "bad.mblt")
    with pytest.raises(TraceFormatError, match=message):
        read_trace(tmp_path / "bad.mblt", "mblt")


def test_mblt_inconsistent_sizes(tmp_path):
    mblt_file(tmp_path / "m.mblt", 8, [(0, [[1, 2]]), (1, [[3, 4]])])
    (tmp_path / "odd.mblt").write_bytes((tmp_path / "m.mblt").read_bytes() + b"\0")
    with pytest.raises(TraceFormatError, match="is not a whole number of int32"):
        read_trace(tmp_path / "odd.mblt")
    with pytest.raises(TraceFormatError, match="records have k 2, but top_k=3"):
        read_trace(tmp_path / "m.mblt", top_k=3)
    with pytest.raises(TraceFormatError, match="n_expert 8 in the header, but num_experts=16"):
        read_trace(tmp_path / "m.mblt", num_experts=16)


# ---------------------------------------------------------------------------------------------
# expert-log lines


def test_expert_log(tmp_path):
    lines = [
        "llama_model_loader: loaded meta data",
        "EXPERT|L1|T0: [3, 1]",
        "EXPERT|L0|T0: [2,5]",
        "  EXPERT|L0|T1: [7, 0]  ",
        "some other output",
        "EXPERT|L1|T1: [4, 6]",
    ]
    path = tmp_path / "run.log"
    path.write_text("\n".join(lines) + "\n")
    assert detect_format(path) == "expert_log"
    tr = read_trace(path)
    assert tr.ids.tolist() == [[[2, 5], [3, 1]], [[7, 0], [4, 6]]]
    assert (tr.num_experts, tr.meta["num_experts_inferred"]) == (8, True)
    assert read_trace(path, num_experts=16).num_experts == 16
    with pytest.raises(TraceFormatError, match=r"line 3: expert ids \[2, 5\] outside"):
        read_trace(path, num_experts=5)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("EXPERT|L1|T1: [4, 6] [1, 2]", "line 3: holds 2 bracketed id lists"),
        ("EXPERT|L1|T1 [4, 6]", "line 3: not of the form EXPERT"),
        ("EXPERT|L1|T1: [4, x]", "line 3: expert ids are not integers"),
        ("EXPERT|L1|T1: [4, 6, 7]", "line 3: inconsistent k: 3 ids, line 1 has 2"),
        ("EXPERT|L1|T3: [4, 6]", "token gap: no record for token 2"),
        ("EXPERT|L1|T0: [4, 6]", "line 3: a second record for token 0, layer 1"),
    ],
)
def test_bad_expert_log(tmp_path, line, message):
    path = tmp_path / "bad.log"
    path.write_text(f"EXPERT|L0|T0: [1, 2]\nEXPERT|L1|T0: [1, 3]\n{line}\nEXPERT|L0|T1: [0, 1]\n")
    with pytest.raises(TraceFormatError, match=message):
        read_trace(path, "expert_log")


# ---------------------------------------------------------------------------------------------
# moesub's own router table, detection


def moesub_router(path, streams: list[np.ndarray], k: int) -> None:
    E = streams[0].shape[2]
    meta = {"num_experts": E, "top_k": k, "num_layers": streams[0].shape[1], "norm_topk_prob": True}
    with router_writer(path, E, meta, lookahead=False) as w:
        for s, z in enumerate(streams):
            w.write_table(router_rows(s, z))


def test_moesub_router_table(tmp_path, logits):
    parts = [logits[:100], logits[100:]]
    moesub_router(tmp_path / "eval_router.parquet", parts, K)
    assert detect_format(tmp_path / "eval_router.parquet") == "moesub"
    tr = read_trace(tmp_path / "eval_router.parquet")
    assert tr.streams == (100, T - 100) and tr.top_k == K and tr.meta["norm_topk_prob"] is True
    np.testing.assert_array_equal(tr.logits, logits)
    np.testing.assert_array_equal(tr.ids, ranked_topk(logits, K))
    trace = Trace(streams=[0, 1], logits=parts, meta=tr.meta)
    np.testing.assert_array_equal(tr.selection_counts(), selection_counts(trace))
    with pytest.raises(TraceFormatError, match="metadata has top_k 4, but top_k=8"):
        read_trace(tmp_path / "eval_router.parquet", top_k=8)


def test_unknown_format(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x00\x01junk")
    with pytest.raises(TraceFormatError, match="cannot tell the format"):
        read_trace(tmp_path / "x.bin")
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        read_trace(tmp_path / "x.bin", "csv")
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "missing.bin")


# ---------------------------------------------------------------------------------------------
# writers: atomic, checked first


def test_writers_leave_nothing_half_written(tmp_path, logits):
    target = tmp_path / "t.rtrace01"
    bad = logits.copy()
    bad[5, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"NaN or inf \(first at index \(5, 1, 2\)\)"):
        write_trace(target, "rtrace01", logits=bad)
    assert not target.exists() and no_temp_files(tmp_path)
    target.write_bytes(b"previous")
    with (
        pytest.raises(ValueError, match="earlier tokens have 3"),
        TraceWriter(target, "rtrace01", E) as w,
    ):
        w.write(logits=logits[:10])
        w.write(logits=logits[10:20, :2])
    assert target.read_bytes() == b"previous" and no_temp_files(tmp_path)
    with pytest.raises(ValueError, match="no tokens written"), TraceWriter(target, "mblt", E):
        pass
    with pytest.raises(ValueError, match=r"row 0: expert ids \[40, 1\] outside"):
        write_trace(tmp_path / "m.mblt", "mblt", ids=np.array([[[40, 1]]]), num_experts=E)
    with pytest.raises(ValueError, match="pass num_experts"):
        write_trace(tmp_path / "m.mblt", "mblt", ids=np.array([[[0, 1]]]))
    with pytest.raises(ValueError, match="cannot write 'expert_log'"):
        write_trace(tmp_path / "m.log", "expert_log", logits=logits)
    assert target.read_bytes() == b"previous" and no_temp_files(tmp_path)
    assert not (tmp_path / "m.mblt").exists()


# ---------------------------------------------------------------------------------------------
# chunked simulation == whole-stream scan

POLICIES = {
    "fetch_every_miss": Policy(),
    "lfu": Policy(eviction="lfu"),
    "rule_015": Policy(rule="threshold", tau=0.15),
    "quality": Policy(rule="threshold", tau=0.15, eviction="lfu", beta=0.5, delay=2),
    "speed": Policy(rule="first_choice", eviction="lfu", beta=0.5),
    "host_compute": Policy(rule="host_compute"),
    "first_choice_host": Policy(rule="first_choice", light_miss="host"),
    "route_bias": Policy(route_bias=0.05),
}
COUNTS = list(COUNTER_NAMES)


def scan_counts(streams: list[np.ndarray], policy: Policy, C: int, initial) -> np.ndarray:
    """(L, 5) status counts per layer from whole-stream scans."""
    out = 0
    for z in streams:
        status = scan(z, K, C, policy, initial).status  # (T, L, k)
        out = out + np.stack([(status == c).sum(axis=(0, 2)) for c in range(len(STATUS_NAMES))], 1)
    return out


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, T])
def test_chunked_equals_whole_scan(tmp_path, logits, chunk_tokens):
    write_trace(tmp_path / "t.rtrace01", "rtrace01", logits=logits)
    f = open_trace(tmp_path / "t.rtrace01", top_k=K)
    tr = f.load()
    counts = selection_counts(
        Trace([0], [tr.logits], {"num_experts": E, "top_k": K, "num_layers": L})
    )
    initial = {capacity_for(f, E): frequency_sets(counts, capacity_for(f, E)) for f in (0.25, 0.5)}
    grid = [
        GridPoint.at_fraction(n, p, frac, E, initial[capacity_for(frac, E)])
        for n, p in POLICIES.items()
        for frac in (0.25, 0.5)
    ]
    got = simulate_trace(f, grid, chunk_tokens=chunk_tokens, n_threads=2)
    whole = simulate([tr.logits], K, grid, belady=False)
    assert got.select("policy", "layer", *COUNTS).equals(whole.select("policy", "layer", *COUNTS))
    np.testing.assert_allclose(got["mass_mean"], whole["mass_mean"], rtol=1e-12, atol=1e-15)
    for g in grid:
        C = capacity_for(g.fraction, E)
        rows = got.filter((got["policy"] == g.name) & (got["fraction"] == g.fraction))
        rows = rows.filter(rows["layer"] >= 0).sort("layer")
        np.testing.assert_array_equal(
            rows.select(*STATUS_NAMES).to_numpy(), scan_counts([tr.logits], g.policy, C, initial[C])
        )


def test_chunked_restarts_per_stream(tmp_path, logits):
    moesub_router(tmp_path / "r.parquet", [logits[:90], logits[90:]], K)
    tr = read_trace(tmp_path / "r.parquet")
    grid = [GridPoint.at_fraction(n, POLICIES[n], 0.25, E) for n in ("fetch_every_miss", "quality")]
    got = simulate_trace(tr, grid, chunk_tokens=32)
    whole = simulate([logits[:90], logits[90:]], K, grid, belady=False)
    assert got.select("policy", "layer", *COUNTS).equals(whole.select("policy", "layer", *COUNTS))
    one_stream = simulate([logits], K, grid, belady=False)
    assert not got.select(*COUNTS).equals(one_stream.select(*COUNTS))  # the restart shows


def test_ids_only_trace_runs_the_rules_that_need_no_logits(tmp_path, logits):
    write_trace(tmp_path / "t.mblt", "mblt", logits=logits, top_k=K)
    ids_only = read_trace(tmp_path / "t.mblt")
    ok = ["fetch_every_miss", "lfu", "host_compute", "first_choice_host"]
    grid = [GridPoint.at_fraction(n, POLICIES[n], 0.25, E) for n in ok]
    got = simulate_trace(ids_only, grid, chunk_tokens=50)
    whole = simulate([logits], K, grid, belady=False)
    assert got.select("policy", "layer", *COUNTS).equals(whole.select("policy", "layer", *COUNTS))
    np.testing.assert_array_equal(ranked_topk(rank_logits(ids_only.ids, E), K), ids_only.ids)
    for name, why in [
        ("rule_015", "rule 'threshold' compares gate weights"),
        ("speed", "rule 'first_choice' picks each substitute by the residents' logits"),
        ("route_bias", "route_bias ranks by every expert's logit"),
    ]:
        with pytest.raises(ValueError, match=f"grid point '{name}': the mblt trace holds expert "
                           f"ids only, and {why}"):  # fmt: skip
            simulate_trace(ids_only, [GridPoint.at_fraction(name, POLICIES[name], 0.25, E)])
    with pytest.raises(ValueError, match="grid point 'p': prefetch reads lookahead logits"):
        simulate_trace(ids_only, [GridPoint.at_fraction("p", Policy(prefetch=2), 0.25, E)])
    with pytest.raises(ValueError, match="grid point 'b': eviction 'belady' needs the whole"):
        simulate_trace(ids_only, [GridPoint.at_fraction("b", Policy(eviction="belady"), 0.25, E)])


# ---------------------------------------------------------------------------------------------
# pin lists


def test_pin_list_round_trip(tmp_path):
    counts = np.array([[0, 5, 2, 5, 9], [1, 0, 0, 0, 0]])
    order = frequency_order(counts)
    assert order == [[4, 1, 3, 2], [0]]  # by count, ties to the lower id, zeros left out
    path = write_pin_list(tmp_path / "m.pinlist", order, 5, comments=["from moesub"])
    assert path.read_text() == (
        "# EXPERT_CACHE_PIN_LIST v1\n# from moesub\nn_layer 2\nn_expert 5\n"
        "layer 0: 4 1 3 2\nlayer 1: 0\n"
    )
    pins = read_pin_list(path)
    assert (pins.num_layers, pins.num_experts, pins.layers) == (2, 5, ((4, 1, 3, 2), (0,)))
    write_pin_list(tmp_path / "h.pinlist", {1: [3, 2]}, 5, num_layers=3)  # non-MoE layers empty
    assert read_pin_list(tmp_path / "h.pinlist").layers == ((), (3, 2), ())
    assert (tmp_path / "h.pinlist").read_text().splitlines()[-1] == "layer 2: "


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("n_layer 1\nn_expert 4\nlayer 0: 1 9\n", r"line 4: expert ids outside \[0, 4\)"),
        ("n_layer 1\nn_expert 4\nlayer 0: 1 1\n", "line 4: an expert is listed twice"),
        ("n_layer 2\nn_expert 4\nlayer 1: 1\n", "line 4: layer 1 where layer 0 was due"),
        ("n_layer 2\nn_expert 4\nlayer 0: 1\n", "1 layer lines, n_layer 2"),
        ("layer 0: 1\n", "line 2: expected 'layer <i>: <ids>' after n_layer and n_expert"),
    ],
)
def test_bad_pin_list(tmp_path, body, message):
    path = tmp_path / "bad.pinlist"
    path.write_text("# EXPERT_CACHE_PIN_LIST v1\n" + body)
    with pytest.raises(ValueError, match=message):
        read_pin_list(path)
    path.write_text("# something else\n" + body)
    with pytest.raises(ValueError, match="line 1: expected '# EXPERT_CACHE_PIN_LIST v1'"):
        read_pin_list(path)
    with pytest.raises(ValueError, match="pin list layer 0: an expert is listed twice"):
        write_pin_list(tmp_path / "w.pinlist", [[1, 1]], 4)
    assert not (tmp_path / "w.pinlist").exists()
