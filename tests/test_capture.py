"""moesub.capture: exact capture on a tiny random Qwen3-Next, trace loading, expert ranking."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import tiny_qwen3_next

from moesub.artefacts import (
    Trace,
    frequency_sets,
    load_trace,
    read_expert_ranking,
    router_rows,
    selection_counts,
    topk_mask,
    write_expert_ranking,
)
from moesub.capture import BackgroundWriter, run_capture, run_expert_ranking
from moesub.io import read_metadata, write_parquet
from moesub.models import moe_blocks

VOCAB, E, K, L = 61, 24, 5, 4
LENGTHS = {3: 37, 0: 25, 7: 2}  # stream id -> length (not in id order, one tiny stream)


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    model = tiny_qwen3_next(vocab=VOCAB, layers=L, experts=E, k=K)
    path = tmp_path_factory.mktemp("model") / "next"
    model.save_pretrained(path)
    return path, model


def make_streams(path, lengths=LENGTHS, seed=0, shuffle=True):
    rng = np.random.default_rng(seed)
    parts = []
    for s, T in lengths.items():
        parts.append(
            {
                "stream": np.full(T, s, np.int32),
                "pos": np.arange(T, dtype=np.int32),
                "token_id": rng.integers(0, VOCAB, T).astype(np.int32),
                "doc_id": (np.arange(T) // 10 + 100 * s).astype(np.int32),
                "doc_start": np.arange(T) % 10 == 0,
            }
        )
    cols = {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
    if shuffle:
        perm = rng.permutation(len(cols["pos"]))
        cols = {c: v[perm] for c, v in cols.items()}
    write_parquet(cols, path, metadata={"docs": {"100": "a"}})
    return cols


@pytest.fixture(scope="module")
def captured(tiny_next, tmp_path_factory):
    model_dir, model = tiny_next
    d = tmp_path_factory.mktemp("capture")
    cols = make_streams(d / "streams.parquet")
    # a small row group size forces several row groups per stream
    params = {"row_group_mb": 2 * 4 * E * L * 8 / 2**20, "name": "tiny"}
    run_capture(model_dir, d / "streams.parquet", d / "tok.parquet", d / "router.parquet", params)
    return d, cols, model


def test_capture_schemas_and_metadata(captured):
    d, cols, _ = captured
    tok = pq.read_table(d / "tok.parquet")
    assert tok.schema.names == ["stream", "pos", "token_id", "doc_id", "doc_start", "nll"]
    assert [str(t) for t in tok.schema.types] == [
        "int32", "int32", "int32", "int32", "bool", "double",
    ]  # fmt: skip
    router = pq.ParquetFile(d / "router.parquet")
    s = router.schema_arrow
    assert s.names == ["stream", "pos", "layer", "logits", "lookahead"]
    assert s.field("stream").type == pa.int32() and s.field("pos").type == pa.int32()
    assert s.field("layer").type == pa.int16()
    t = s.field("logits").type
    assert pa.types.is_fixed_size_binary(t) and t.byte_width == 4 * E  # E float32 per row
    assert s.field("lookahead").type == t
    assert router.metadata.num_rows == sum(LENGTHS.values()) * L
    assert router.num_row_groups > len(LENGTHS)
    meta = read_metadata(d / "router.parquet")
    assert {k: meta[k] for k in ("num_experts", "top_k", "num_layers", "norm_topk_prob")} == {
        "num_experts": E, "top_k": K, "num_layers": L, "norm_topk_prob": True,
    }  # fmt: skip
    assert meta["model"] == "tiny" and meta["family"] == "qwen3_next"
    tmeta = read_metadata(d / "tok.parquet")
    assert tmeta["docs"] == {"100": "a"} and tmeta["num_experts"] == E
    # rows sorted by (stream, pos); first position of each stream has a null nll
    stream, pos = tok.column("stream").to_numpy(), tok.column("pos").to_numpy()
    assert (np.diff(stream.astype(np.int64) * 1000 + pos) > 0).all()
    assert (
        tok.column("nll").is_null().to_numpy(zero_copy_only=False).tolist() == (pos == 0).tolist()
    )


def _stream_ids(cols, s):
    sel = cols["stream"] == s
    return cols["token_id"][sel][np.argsort(cols["pos"][sel])]


def test_capture_nll_and_logits_match_plain_forward(captured):
    d, cols, model = captured
    tok = pq.read_table(d / "tok.parquet").to_pydict()
    trace = load_trace(d / "router.parquet")
    assert trace.streams == sorted(LENGTHS)
    stream = np.array(tok["stream"])
    for s, z in zip(trace.streams, trace.logits, strict=True):
        ids = torch.from_numpy(_stream_ids(cols, s).astype(np.int64))[None]
        with torch.no_grad():
            out = model(ids, output_router_logits=True, use_cache=False)
        lp = torch.log_softmax(out.logits.float(), dim=-1)
        ref = -lp[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1).double().numpy()
        nll = np.array(tok["nll"], dtype=object)[stream == s]
        assert nll[0] is None
        np.testing.assert_array_equal(nll[1:].astype(np.float64), ref)
        assert z.dtype == np.float32 and z.shape == (LENGTHS[s], L, E)
        ref_z = torch.stack(list(out.router_logits), dim=1).numpy()  # (T, L, E)
        np.testing.assert_array_equal(z, ref_z)


def _write_trace(path, logits_by_stream, meta=None, shuffle=False):
    tables = [router_rows(s, z) for s, z in logits_by_stream.items()]
    table = pa.concat_tables(tables)
    if shuffle:
        table = table.take(np.random.default_rng(0).permutation(table.num_rows))
    z0 = next(iter(logits_by_stream.values()))
    m = {"num_experts": z0.shape[2], "top_k": 2, "num_layers": z0.shape[1]}
    m["norm_topk_prob"] = True
    m.update(meta or {})
    write_parquet(table, path, metadata=m)


def test_load_trace_round_trip_any_row_order(tmp_path):
    rng = np.random.default_rng(1)
    data = {5: rng.normal(size=(7, 3, 6)).astype(np.float32), -1: rng.normal(size=(4, 3, 6))}
    data[-1] = data[-1].astype(np.float32)
    _write_trace(tmp_path / "r.parquet", data, shuffle=True)
    tr = load_trace(tmp_path / "r.parquet")
    assert tr.streams == [-1, 5] and tr.num_tokens == 11 and tr.num_layers == 3
    for s, z in zip(tr.streams, tr.logits, strict=True):
        np.testing.assert_array_equal(z, data[s])


def test_load_trace_errors(tmp_path):
    good = {0: np.zeros((3, 2, 4), np.float32)}
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        load_trace(tmp_path / "missing.parquet")
    bad = dict(good)
    bad[0] = good[0].copy()
    bad[0][1, 1, 2] = np.nan
    _write_trace(tmp_path / "nan.parquet", bad)
    with pytest.raises(ValueError, match=r"nan.parquet.*NaN.*stream 0, pos 1, layer 1"):
        load_trace(tmp_path / "nan.parquet")
    bad[0][1, 1, 2] = np.inf
    _write_trace(tmp_path / "inf.parquet", bad)
    with pytest.raises(ValueError, match="infinite"):
        load_trace(tmp_path / "inf.parquet")
    # logits as a variable-size list of doubles
    t = pa.table(
        {"stream": [0], "pos": [0], "layer": [0], "logits": pa.array([[0.0, 1.0]])}
    ).replace_schema_metadata({b"num_experts": b"2", b"top_k": b"1", b"num_layers": b"1",
                               b"norm_topk_prob": b"true"})  # fmt: skip
    pq.write_table(t, tmp_path / "schema.parquet")
    with pytest.raises(ValueError, match=r"schema.parquet.*wrong schema.*logits"):
        load_trace(tmp_path / "schema.parquet")
    pq.write_table(router_rows(0, good[0]), tmp_path / "nometa.parquet")
    with pytest.raises(ValueError, match="missing metadata"):
        load_trace(tmp_path / "nometa.parquet")
    rows = router_rows(0, good[0])
    write_parquet(rows.slice(0, 5), tmp_path / "short.parquet",
                  metadata={"num_experts": 4, "top_k": 1, "num_layers": 2,
                            "norm_topk_prob": True})  # fmt: skip
    with pytest.raises(ValueError, match="short.parquet.*stream 0 has 5 rows"):
        load_trace(tmp_path / "short.parquet")
    write_parquet(pa.concat_tables([rows, rows.slice(0, 1)]), tmp_path / "dup.parquet",
                  metadata={"num_experts": 4, "top_k": 1, "num_layers": 2,
                            "norm_topk_prob": True})  # fmt: skip
    with pytest.raises(ValueError, match="duplicate"):
        load_trace(tmp_path / "dup.parquet")


def test_capture_input_errors(tiny_next, tmp_path):
    model_dir, _ = tiny_next
    out = (tmp_path / "t.parquet", tmp_path / "r.parquet")
    with pytest.raises(FileNotFoundError, match="nostreams"):
        run_capture(model_dir, tmp_path / "nostreams.parquet", *out)
    cols = make_streams(tmp_path / "s.parquet", shuffle=False)
    gap = {c: v.copy() for c, v in cols.items()}
    gap["pos"][3] = 50
    write_parquet(gap, tmp_path / "gap.parquet")
    with pytest.raises(ValueError, match="gap.parquet.*positions"):
        run_capture(model_dir, tmp_path / "gap.parquet", *out)
    oov = {c: v.copy() for c, v in cols.items()}
    oov["token_id"][0] = VOCAB
    write_parquet(oov, tmp_path / "oov.parquet")
    with pytest.raises(ValueError, match="oov.parquet.*vocabulary"):
        run_capture(model_dir, tmp_path / "oov.parquet", *out)
    write_parquet({k: v for k, v in cols.items() if k != "doc_id"}, tmp_path / "nodoc.parquet")
    with pytest.raises(ValueError, match="doc_id"):
        run_capture(model_dir, tmp_path / "nodoc.parquet", *out)
    with pytest.raises(ValueError, match="unknown capture option"):
        run_capture(model_dir, tmp_path / "s.parquet", *out, params={"batch": 4})
    with pytest.raises(FileNotFoundError, match="nomodel"):
        run_capture(tmp_path / "nomodel", tmp_path / "s.parquet", *out)
    assert not out[0].exists() and not out[1].exists()


def test_capture_rejects_non_finite_router_logits(tmp_path):
    """A NaN in one router's weights makes its logits NaN: the capture names the stream and
    leaves no output behind."""
    model = tiny_qwen3_next(vocab=VOCAB, layers=L, experts=E, k=K)
    with torch.no_grad():
        moe_blocks(model)[1].gate.weight[3, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    make_streams(tmp_path / "s.parquet")
    out = (tmp_path / "t.parquet", tmp_path / "r.parquet")
    with pytest.raises(ValueError, match=r"stream \d+: the model produced NaN or infinite"):
        run_capture(tmp_path / "nan_model", tmp_path / "s.parquet", *out)
    assert not out[0].exists() and not out[1].exists()


def test_capture_checks_every_logit_when_a_sum_is_not_finite(tiny_next, captured, monkeypatch):
    """The per-layer sums only vouch for finite logits; when one is not finite (as if it had
    overflowed) every logit is checked, and finite logits are captured all the same."""
    model_dir, _ = tiny_next
    d, _, _ = captured
    monkeypatch.setattr("moesub.capture._Recorder.all_finite", lambda self: False)
    out = (d / "checked_tok.parquet", d / "checked_router.parquet")
    run_capture(model_dir, d / "streams.parquet", *out, {"name": "tiny"})
    ref, got = load_trace(d / "router.parquet", True), load_trace(out[1], True)
    assert got.streams == ref.streams
    for a, b in zip(ref.logits + ref.lookahead, got.logits + got.lookahead, strict=True):
        np.testing.assert_array_equal(a, b)


def _brute_topk(z: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-z, axis=-1, kind="stable")[..., :k]
    mask = np.zeros(z.shape, bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask


def test_topk_mask_ties_to_lower_id():
    rng = np.random.default_rng(3)
    z = rng.integers(-3, 3, size=(200, 3, 9)).astype(np.float32)  # many ties
    for k in (1, 2, 4, 9):
        np.testing.assert_array_equal(topk_mask(z, k), _brute_topk(z, k))
    np.testing.assert_array_equal(
        topk_mask(np.array([[1.0, 2.0, 2.0, 2.0, 0.0]], np.float32), 2),
        [[False, True, True, False, False]],
    )


def test_expert_ranking_ties():
    # layer 0: expert 3 always first; experts 1 and 4 tie for the second place (count 1 each)
    z = np.full((2, 2, 5), -1.0, np.float32)
    z[:, 0, 3] = 5.0
    z[0, 0, 4] = 1.0
    z[1, 0, 1] = 1.0
    z[:, 1, :] = np.array([0.0, 0.0, 1.0, 0.0, 0.0])  # layer 1: 2 first, then ties 0 < 1 < ...
    tr = Trace(streams=[0], logits=[z], meta={"num_experts": 5, "top_k": 2, "num_layers": 2})
    counts = selection_counts(tr)
    assert counts.tolist() == [[0, 1, 0, 2, 1], [2, 0, 2, 0, 0]]
    ranking = frequency_sets(counts, 5)
    assert ranking.tolist() == [[3, 1, 4, 0, 2], [0, 2, 1, 3, 4]] and ranking.dtype == np.int32
    # every capacity's frequency set is the ranking's prefix
    assert frequency_sets(counts, 2).tolist() == [[3, 1], [0, 2]]
    assert frequency_sets(counts, 3).tolist() == [[3, 1, 4], [0, 2, 1]]


def test_expert_ranking_file_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    data = {0: rng.normal(size=(50, 3, 16)).astype(np.float32)}
    data[1] = rng.normal(size=(30, 3, 16)).astype(np.float32)
    data[1][:, 1, 5] = data[1][:, 1, 6] = 9.0  # a tie within every token's top-3
    _write_trace(tmp_path / "calib.parquet", data, meta={"top_k": 3})
    out = tmp_path / "ranking.parquet"
    run_expert_ranking(tmp_path / "calib.parquet", out)
    t = pq.read_table(out)
    assert t.schema.names == ["layer", "rank", "expert", "count"]
    assert [str(x) for x in t.schema.types] == ["int16", "int32", "int32", "int64"]
    assert read_metadata(out)["tokens"] == 80 and read_metadata(out)["num_experts"] == 16
    ranking = read_expert_ranking(out, 3, 16)
    # brute force: count top-3 membership, order by (-count, id); every C's frequency set (the
    # capture's initial sets before the ranking) is the ranking's first C experts
    counts = _brute_topk(np.concatenate([data[0], data[1]]), 3).sum(axis=0)  # (L, E)
    for layer in range(3):
        order = sorted(range(16), key=lambda e: (-counts[layer, e], e))
        assert ranking[layer].tolist() == order
        assert t.column("count").to_numpy()[layer * 16 : (layer + 1) * 16].tolist() == sorted(
            counts[layer].tolist(), reverse=True
        )
        for c in range(3, 17):
            assert frequency_sets(counts, c)[layer].tolist() == order[:c]
    with pytest.raises(ValueError, match="48 rows .* the model.s 2 layers x 16 experts"):
        read_expert_ranking(out, 2, 16)  # a ranking of another model
    with pytest.raises(FileNotFoundError, match="noranking"):
        read_expert_ranking(tmp_path / "noranking.parquet", 3, 16)
    write_expert_ranking(counts, tmp_path / "ok.parquet", {})
    table = pq.read_table(tmp_path / "ok.parquet")
    twice = table.set_column(2, "expert", pa.array(np.zeros(48, np.int32)))
    pq.write_table(twice, tmp_path / "twice.parquet")
    with pytest.raises(ValueError, match="each expert 0..E-1 once"):
        read_expert_ranking(tmp_path / "twice.parquet", 3, 16)


def test_background_writer_writes_in_order_and_reraises():
    class Sink:
        def __init__(self):
            self.got = []

        def write_table(self, t):
            if t.num_rows == 0:
                raise OSError("disk full")
            self.got.append(t.column("x")[0].as_py())

    sink = Sink()
    with BackgroundWriter(sink) as w:
        for i in range(20):
            w.write_table(pa.table({"x": [i]}))
    assert sink.got == list(range(20))
    w = BackgroundWriter(Sink())
    w.write_table(pa.table({"x": pa.array([], pa.int64())}))
    with pytest.raises(OSError, match="disk full"):
        w.close()
