"""Evaluation / calibration token streams: schema, topic boundaries, sources, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moesub import corpus, embedded, streams
from moesub.documents import read_text_file
from moesub.io import read_metadata, write_parquet
from moesub.streams import build_streams

PARAMS = {
    "eval": {"n_streams": 3, "stream_len": 300},
    "calib": {"n_streams": 2, "stream_len": 200},
    "doc_tokens_max": 96,
    "seed": 0,
}
WORDS = [
    "alpha beta gamma delta epsilon", "river mountain valley forest lake",
    "integer float string tuple list", "violin piano trumpet cello drum",
    "apple pear cherry plum grape", "north south east west center",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """What build_streams needs from a model dir: tokenizer, config.json, corpus_files.parquet."""
    out = tmp_path_factory.mktemp("model")
    docs, texts = corpus.collect_corpus(embedded.EmbeddedConfig())
    train = [t for d, t in zip(docs, texts, strict=True) if d.split == "train"][:60]
    tok = corpus.train_tokenizer(train + [" ".join(WORDS)] * 5, 600)
    tok.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "vocab_size": 600}))
    write_parquet(corpus.corpus_table(docs), out / "corpus_files.parquet")
    return out


def _build(model_dir, tmp_path, source=None, params=None, tag="a"):
    out_eval, out_calib = tmp_path / f"eval_{tag}.parquet", tmp_path / f"calib_{tag}.parquet"
    build_streams(
        model_dir, source or {"kind": "embedded"}, PARAMS if params is None else params,
        out_eval, out_calib,
    )  # fmt: skip
    return out_eval, out_calib


def _check_layout(path: Path, n_streams: int, stream_len: int, doc_max: int) -> list[dict]:
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == streams.STREAM_SCHEMA
    cols = {k: table[k].to_numpy() for k in table.column_names}
    assert table.num_rows == n_streams * stream_len
    assert np.array_equal(cols["stream"], np.repeat(np.arange(n_streams), stream_len))
    assert np.array_equal(cols["pos"], np.tile(np.arange(stream_len), n_streams))
    pieces = read_metadata(path)["docs"]
    # doc_start exactly at each piece's first token; doc_id constant within a piece
    expected_start = np.zeros(table.num_rows, dtype=bool)
    for p in pieces:
        row = p["stream"] * stream_len + p["start"]
        expected_start[row] = True
        assert np.all(cols["doc_id"][row : row + p["tokens"]] == p["doc_id"])
        assert 1 <= p["tokens"] <= doc_max
    assert np.array_equal(cols["doc_start"], expected_start)
    assert cols["doc_start"][cols["pos"] == 0].all()
    assert sorted(p["doc_id"] for p in pieces) == list(range(len(pieces)))
    # consecutive pieces of a stream come from different packages
    for s in range(n_streams):
        pkgs = [p["package"] for p in pieces if p["stream"] == s]
        assert len(pkgs) >= 2
        assert all(a != b for a, b in zip(pkgs, pkgs[1:], strict=False))
    return pieces


def test_embedded_streams_layout_and_boundaries(model_dir, tmp_path):
    from transformers import AutoTokenizer

    out_eval, out_calib = _build(model_dir, tmp_path)
    ev = _check_layout(out_eval, 3, 300, 96)
    ca = _check_layout(out_calib, 2, 200, 96)
    files = pq.read_table(model_dir / "corpus_files.parquet").to_pydict()
    split = dict(zip(files["path"], files["split"], strict=True))
    package = dict(zip(files["path"], files["package"], strict=True))
    assert all(split[p["name"]] == "eval" for p in ev)
    assert all(split[p["name"]] == "calib" for p in ca)
    assert all(package[p["name"]] == p["package"] for p in ev + ca)
    # in these sizes no stream needs to repeat a package
    for s in range(3):
        pkgs = [p["package"] for p in ev if p["stream"] == s]
        assert len(set(pkgs)) == len(pkgs)
    # each piece is the start of its document's own tokenization
    tok = AutoTokenizer.from_pretrained(model_dir)
    table = pq.read_table(out_eval).to_pydict()
    ids = np.asarray(table["token_id"])
    for p in ev:
        text = corpus.read_document(p["name"])
        expected = tok(text, add_special_tokens=False)["input_ids"][: p["tokens"]]
        row = p["stream"] * 300 + p["start"]
        assert ids[row : row + p["tokens"]].tolist() == expected
    meta = read_metadata(out_eval)
    assert meta["split"] == "eval" and meta["source"] == {"kind": "embedded"}
    assert meta["params"]["doc_tokens_max"] == 96


def test_deterministic_and_seeded(model_dir, tmp_path):
    a = _build(model_dir, tmp_path, tag="a")
    b = _build(model_dir, tmp_path, tag="b")
    for x, y in zip(a, b, strict=True):
        assert pq.read_table(x).equals(pq.read_table(y))
        assert read_metadata(x)["docs"] == read_metadata(y)["docs"]
    c = _build(model_dir, tmp_path, params={**PARAMS, "seed": 1}, tag="c")
    assert read_metadata(a[0])["docs"] != read_metadata(c[0])["docs"]


def _topic_docs(n_per_topic: int = 4) -> list[tuple[str, str]]:
    """(topic, text) pairs: each text long enough to exceed doc_tokens_min."""
    rng = np.random.default_rng(0)
    out = []
    for t, words in enumerate(WORDS):
        vocab = words.split()
        for _ in range(n_per_topic):
            out.append((f"topic{t}", " ".join(rng.choice(vocab, size=80)) + "."))
    return out


def test_text_source_txt(model_dir, tmp_path):
    docs = _topic_docs()
    path = tmp_path / "docs.txt"
    body = "\n\n".join(t for _, t in docs[:12]) + "\f" + "\n \n".join(t for _, t in docs[12:])
    path.write_text(body)
    parsed = read_text_file(path)
    assert [d.text for d in parsed] == [t for _, t in docs]
    assert len({d.package for d in parsed}) == len(docs)  # each document its own package
    source = {"kind": "text", "path": str(path), "calib_fraction": 0.3}
    params = {**PARAMS, "eval": {"n_streams": 2, "stream_len": 150}, "calib": {"n_streams": 1}}
    params["calib"]["stream_len"] = 100
    out_eval, out_calib = _build(model_dir, tmp_path, source, params)
    ev = _check_layout(out_eval, 2, 150, 96)
    ca = _check_layout(out_calib, 1, 100, 96)
    assert not {p["name"] for p in ev} & {p["name"] for p in ca}


def test_text_source_jsonl_and_parquet_with_packages(model_dir, tmp_path):
    docs = _topic_docs()
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "topic": k}) + "\n" for k, t in docs))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": [t for _, t in docs], "topic": [k for k, _ in docs]}), parquet)
    params = {**PARAMS, "eval": {"n_streams": 2, "stream_len": 200}}
    params["calib"] = {"n_streams": 1, "stream_len": 150}
    src_j = {"kind": "text", "path": str(jsonl), "package_field": "topic", "calib_path": str(jsonl)}
    src_p = {"kind": "text", "path": str(parquet), "field": "body", "package_field": "topic"}
    src_p["calib_path"] = str(parquet)
    ej, _ = _build(model_dir, tmp_path, src_j, params, tag="j")
    ep, _ = _build(model_dir, tmp_path, src_p, params, tag="p")
    pieces = _check_layout(ej, 2, 200, 96)
    assert {p["package"] for p in pieces} <= {f"topic{i}" for i in range(len(WORDS))}
    # same documents, same order, same tokens whatever the container
    assert pq.read_table(ej).equals(pq.read_table(ep))
    with pytest.raises(ValueError, match="no column 'nope'"):
        read_text_file(parquet, text_field="nope")
    with pytest.raises(ValueError, match="no field 'nope'"):
        read_text_file(parquet.with_suffix(".jsonl"), package_field="nope")


def test_datasets_source_from_disk_and_offline_error(model_dir, tmp_path, monkeypatch):
    import datasets

    docs = _topic_docs()
    ds = datasets.Dataset.from_dict({"text": [t for _, t in docs], "topic": [k for k, _ in docs]})
    ds.save_to_disk(str(tmp_path / "ds"))
    source = {"kind": "datasets", "name": str(tmp_path / "ds"), "split": "train"}
    source["package_field"] = "topic"
    params = {**PARAMS, "eval": {"n_streams": 1, "stream_len": 150}}
    params["calib"] = {"n_streams": 1, "stream_len": 100}
    out_eval, _ = _build(model_dir, tmp_path, source, params)
    _check_layout(out_eval, 1, 150, 96)

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="offline"):
        _build(model_dir, tmp_path, {"kind": "datasets", "name": "someone/corpus"}, params, "x")
    assert not (tmp_path / "eval_x.parquet").exists()


@pytest.mark.parametrize(
    ("source", "params", "exc", "match"),
    [
        ({"kind": "embedded"}, {"n_stream": 3}, ValueError, "n_stream"),
        ({"kind": "embedded"}, {"eval": {"streams": 3}}, ValueError, "streams"),
        ({"kind": "embedded"}, {"eval": {"n_streams": 0}}, ValueError, "n_streams"),
        ({"kind": "embedded"}, {"doc_tokens_min": 500}, ValueError, "doc_tokens_min"),
        ({"kind": "web"}, {}, ValueError, "kind"),
        ({"kind": "embedded", "path": "x"}, {}, ValueError, "path"),
        ({"kind": "text"}, {}, ValueError, "path"),
        ({"kind": "text", "path": "/nonexistent.txt"}, {}, FileNotFoundError, "path"),
        ({"kind": "embedded"}, {"eval": {"n_streams": 500}}, ValueError, "not enough documents"),
        # eval would succeed: nothing may be written when calib fails
        ({"kind": "embedded"}, {"calib": {"n_streams": 500}}, ValueError, "not enough documents"),
    ],
)
def test_bad_input(model_dir, tmp_path, source, params, exc, match):
    with pytest.raises(exc, match=match):
        _build(model_dir, tmp_path, source, params)
    assert not list(tmp_path.glob("*.parquet"))


def test_missing_model_dir_and_corpus(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="model_dir"):
        _build(tmp_path / "nope", tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="corpus_files.parquet"):
        _build(bare, tmp_path)


def test_missing_tokenizer_says_so(model_dir, tmp_path):
    """A checkpoint without tokenizer files: transformers would build an empty tokenizer from
    config.json and every stream would stop at 0 tokens; the error names the tokenizer."""
    bare = tmp_path / "notok"
    bare.mkdir()
    for name in ("config.json", "corpus_files.parquet"):
        (bare / name).write_bytes((model_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"notok' has no tokenizer"):
        _build(bare, tmp_path)


def test_token_ids_validated_against_model_vocab(model_dir, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "corpus_files.parquet"):
        (small / name).write_bytes((model_dir / name).read_bytes())
    (small / "config.json").write_text(json.dumps({"vocab_size": 300}))  # < tokenizer's 600
    with pytest.raises(ValueError, match="outside"):
        _build(small, tmp_path)
