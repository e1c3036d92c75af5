"""moesub's exported traces read by the peers' own code (PyPI: fitz-tec 0.1.1, mbolt 0.1.0;
both in the `dev` extra, pure Python over NumPy). Each test skips, with the reason, where its
package is not installed."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from moesub.artefacts import Trace, frequency_sets, selection_counts
from moesub.policy import HIT, Policy, scan
from moesub.synthetic import synthetic_logits
from moesub.traces import frequency_order, rank_logits, read_pin_list, read_trace, write_trace
from moesub.traces.base import softmax_probabilities

T, L, E, K, C = 400, 4, 64, 6, 16


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return synthetic_logits(T, L, E, seed=11)  # (T, L, E)


def counts_of(logits: np.ndarray, k: int) -> np.ndarray:
    return selection_counts(Trace([0], [logits], {"num_experts": E, "top_k": k, "num_layers": L}))


def test_fitz_build_pin_list_gives_moesub_frequency_order(tmp_path, logits):
    pin_tool = pytest.importorskip(
        "fitz_tec.tools.build_pin_list", reason="fitz-tec (PyPI, dev extra) is not installed"
    )
    fitz_format = pytest.importorskip("fitz_tec.tools._trace_format")
    path = write_trace(tmp_path / "eval.rtrace01", "rtrace01", logits=logits)
    theirs = fitz_format.load_trace(path)
    assert (theirs.n_tokens, theirs.n_layers, theirs.n_experts) == (T, L, E)
    np.testing.assert_array_equal(theirs.probs, softmax_probabilities(logits))
    n_layer, n_expert, by_layer = pin_tool.build_pin_list(path, top_k=K, limit_per_layer=None)
    assert (n_layer, n_expert) == (L, E)
    ours = frequency_order(counts_of(logits, K))
    assert by_layer == ours
    # their pin-list file reads back here; the hottest C are moesub's frequency initial set
    pin_tool.emit_pin_list(tmp_path / "fitz.pinlist", n_layer, n_expert, by_layer, path, K)
    pins = read_pin_list(tmp_path / "fitz.pinlist")
    assert [list(p) for p in pins.layers] == ours
    hottest = np.array([p[:C] for p in pins.layers])
    np.testing.assert_array_equal(hottest, frequency_sets(counts_of(logits, K), C))
    # and moesub's own reading of the same file selects what fitz counted
    np.testing.assert_array_equal(
        read_trace(path, top_k=K).selection_counts(), counts_of(logits, K)
    )


def mbolt_lru_hits(ids: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """Per-layer hits of mbolt's LRU fed `ids` (T, L, k) rank by rank, each layer starting full
    with `initial` (L, C): least recently used first, which for moesub's initial residents
    (all last used at -1) is the lower id first."""
    from mbolt.replay import LRU

    lru = LRU(ids.shape[1], initial.shape[1])
    for layer, experts in enumerate(initial):
        lru.layers[layer] = OrderedDict((int(e), None) for e in np.sort(experts))
    hits = np.zeros(ids.shape[1], np.int64)
    for t in range(ids.shape[0]):
        for layer in range(ids.shape[1]):
            for e in ids[t, layer]:
                hits[layer] += lru.access(layer, int(e))
    return hits


def moesub_lru_hits(ids: np.ndarray, initial: np.ndarray) -> np.ndarray:
    r = scan(rank_logits(ids, E), ids.shape[2], initial.shape[1], Policy(), initial)
    return (r.status == HIT).sum(axis=(0, 2))


def test_mbolt_reads_moesub_mblt_and_its_lru_gives_moesub_hits(tmp_path, logits):
    mbolt_trace = pytest.importorskip(
        "mbolt.trace", reason="mbolt (PyPI, dev extra) is not installed"
    )
    pytest.importorskip(
        "mbolt.replay", reason="mbolt's replay module needs gguf (mbolt's dependency)"
    )
    ids = read_trace(write_trace(tmp_path / "a.rtrace01", "rtrace01", logits=logits), top_k=K).ids
    path = write_trace(tmp_path / "eval.mblt", "mblt", ids=ids, num_experts=E)
    theirs = mbolt_trace.read_trace(str(path))
    assert (theirs.n_expert, theirs.n_layers, theirs.k) == (E, L, K)
    np.testing.assert_array_equal(theirs.decode, ids)  # decode passes: [T, L, k]
    assert all(len(p) == 0 for p in theirs.prefill_per_layer)
    initial = frequency_sets(counts_of(logits, K), C)
    # k = 1: the two LRUs are the same algorithm, hit for hit
    top1 = np.ascontiguousarray(theirs.decode[:, :, :1])
    np.testing.assert_array_equal(mbolt_lru_hits(top1, initial), moesub_lru_hits(top1, initial))
    np.testing.assert_array_equal(
        moesub_lru_hits(top1, initial),
        (scan(logits, 1, C, Policy(), initial).status == HIT).sum(axis=(0, 2)),
    )
    # k > 1: mbolt updates its LRU expert by expert, so it equals moesub's LRU over the same ids
    # taken one rank per step; moesub's own step pins a token's whole selection
    # (docs/policy-semantics.md step 4) and ties that token's recency by id (docs/traces.md)
    one_per_step = theirs.decode.transpose(0, 2, 1).reshape(T * K, L, 1)
    theirs_hits = mbolt_lru_hits(theirs.decode, initial)
    np.testing.assert_array_equal(theirs_hits, moesub_lru_hits(one_per_step, initial))
    ours = (scan(logits, K, C, Policy(), initial).status == HIT).sum(axis=(0, 2))
    assert not np.array_equal(theirs_hits, ours)  # the two step rules differ at k > 1
