"""A model given as a trace (moesub.traces.models): the streams and split of the import, the
router tables it writes, the policies an ids-only trace runs, the export, and the config's
parse-time checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moesub import config as mcfg
from moesub.artefacts import load_trace, router_rows, router_writer
from moesub.hardware import STUDY_PROFILE, THIS_MACHINE
from moesub.synthetic import synthetic_logits
from moesub.traces import TraceFormatError, rank_logits, ranked_topk, read_trace, write_trace
from moesub.traces.base import probabilities_to_logits, softmax_probabilities
from moesub.traces.models import (
    cut_streams,
    export_trace,
    exported_source,
    import_trace,
    trace_hardware,
    trace_policies,
)

T, L, E, K = 300, 2, 16, 2
POLICIES = {
    "fetch_every_miss": {"rule": "fetch_all", "eviction": "lru"},
    "host_compute": {"rule": "host_compute", "eviction": "lfu"},
    "pinned": {"rule": "fetch_all", "eviction": "lru", "pin": "50%"},
    "rule_015": {"rule": "threshold", "tau": 0.15, "eviction": "lru"},
    "prefetch_2": {"rule": "fetch_all", "eviction": "lru", "prefetch": 2},
    "cache_prior": {"rule": "fetch_all", "eviction": "lru", "route_bias": 0.1},
}


@pytest.fixture(scope="module")
def logits() -> np.ndarray:
    return synthetic_logits(T, L, E, seed=3)  # (T, L, E)


def as_log_p(z: np.ndarray) -> np.ndarray:
    """What RTRACE01 gives back for logits z: the log of their float32 softmax."""
    return probabilities_to_logits(softmax_probabilities(z))


def test_cut_streams():
    assert cut_streams((10,), 4) == [(0, 4), (4, 8), (8, 10)]
    assert cut_streams((3, 5), 4) == [(0, 3), (3, 7), (7, 8)]
    assert cut_streams((8,), 8) == [(0, 8)]


def test_import_one_rtrace01_first_streams_calibrate(tmp_path, logits):
    path = write_trace(tmp_path / "t.rtrace01", "rtrace01", logits=logits)
    spec = {"trace": str(path), "top_k": K, "stream_len": 128, "calib_streams": 1}
    out = [tmp_path / n for n in ("calib.parquet", "eval.parquet", "trace.json")]
    summary = import_trace("m", spec, *out)
    cal, ev = load_trace(out[0]), load_trace(out[1])
    z = as_log_p(logits)
    assert [a.shape[0] for a in cal.logits] == [128]
    assert [a.shape[0] for a in ev.logits] == [128, 44]  # the remainder a shorter stream
    np.testing.assert_array_equal(cal.logits[0], z[:128])
    np.testing.assert_array_equal(np.concatenate(ev.logits), z[128:])
    assert (cal.top_k, ev.num_layers, ev.num_experts) == (K, L, E)
    assert ev.meta["trace_logits"] == "log_probabilities"
    on_disk = json.loads(out[2].read_text())
    assert on_disk == summary and summary["calib_tokens"] == 128 and summary["eval_tokens"] == 172
    # the same selections as the source logits
    np.testing.assert_array_equal(ranked_topk(cal.logits[0], K), ranked_topk(logits[:128], K))


def test_import_with_calib_trace_and_errors(tmp_path, logits):
    ev = write_trace(tmp_path / "e.mblt", "mblt", logits=logits, top_k=K)
    cal = write_trace(tmp_path / "c.mblt", "mblt", logits=logits[:100], top_k=K)
    out = [tmp_path / n for n in ("calib.parquet", "eval.parquet", "trace.json")]
    spec = {"trace": str(ev), "calib_trace": str(cal), "stream_len": 150}
    summary = import_trace("m", spec, *out)
    assert (summary["calib_streams"], summary["eval_streams"]) == (1, 2)
    # ids only: rank-order stand-in logits, which select exactly the ids
    tr = load_trace(out[1])
    np.testing.assert_array_equal(np.concatenate(tr.logits), rank_logits(ranked_topk(logits, K), E))
    assert tr.meta["trace_logits"] == "rank_logits"
    # a split that leaves nothing to evaluate, a calibration trace of another geometry
    with pytest.raises(ValueError, match="leaves none to evaluate"):
        import_trace("m", {"trace": str(ev), "stream_len": 300}, *out)
    other = write_trace(tmp_path / "o.mblt", "mblt", logits=logits[:, :1], top_k=K)
    with pytest.raises(ValueError, match="models.m.calib_trace: E 16, k 2, 1 layers"):
        import_trace("m", {**spec, "calib_trace": str(other)}, *out)


def test_ids_only_trace_skips_or_rejects_the_policies_needing_logits():
    cfg = {"models": {"m": {"trace": "x.mblt"}}}
    run, skipped = trace_policies(cfg, "m", list(POLICIES), POLICIES, has_logits=False)
    assert run == ["fetch_every_miss", "host_compute", "pinned"]
    assert set(skipped) == {"rule_015", "prefetch_2", "cache_prior"}
    assert "tau" in skipped["rule_015"] and "expert ids only" in skipped["rule_015"]
    assert "lookahead" in skipped["prefetch_2"]
    # with logits only prefetch is left out
    run, skipped = trace_policies(cfg, "m", list(POLICIES), POLICIES, has_logits=True)
    assert list(skipped) == ["prefetch_2"]
    # a policy listed for the model that it cannot run is a config error naming both
    cfg["models"]["m"]["policies"] = ["fetch_every_miss", "rule_015"]
    with pytest.raises(ValueError, match=r"models.m.policies: policy 'rule_015' cannot run: "):
        trace_policies(cfg, "m", list(POLICIES), POLICIES, has_logits=False)
    cfg["models"]["m"]["policies"] = ["fetch_every_miss"]
    assert trace_policies(cfg, "m", list(POLICIES), POLICIES, False) == (["fetch_every_miss"], {})


def test_trace_model_is_priced_on_every_profile_but_this_machine():
    """this_machine is fitted to the engine's runs of the model, which a trace model has none
    of; the other profiles price it at the reference model's bytes, as the embedded model."""
    run, skipped = trace_hardware("m", [THIS_MACHINE, STUDY_PROFILE, "mine"])
    assert run == [STUDY_PROFILE, "mine"] and list(skipped) == [THIS_MACHINE]
    assert "no weights to run" in skipped[THIS_MACHINE]
    assert trace_hardware("m", ["mine"]) == (["mine"], {})
    with pytest.raises(ValueError, match="models.m: a trace model is priced on the profiles of "):
        trace_hardware("m", [THIS_MACHINE])
    cfg = {"models": {"m": {"trace": "x.mblt"}, "e": {"embedded": True}}}
    assert mcfg.pricing_bytes(cfg, "m") == mcfg.pricing_bytes(cfg, "e")


def test_export_round_trip(tmp_path, logits):
    router = tmp_path / "eval_router.parquet"
    meta = {"num_experts": E, "top_k": K, "num_layers": L, "norm_topk_prob": True}
    with router_writer(router, E, meta, lookahead=False) as w:
        w.write_table(router_rows(0, logits[:200]))
        w.write_table(router_rows(1, logits[200:]))
    outs = {"rtrace01": tmp_path / "e.rtrace01", "mblt": tmp_path / "e.mblt"}
    export_trace(router, outs)
    for path in outs.values():
        tr = read_trace(path, top_k=K)  # the streams concatenated
        np.testing.assert_array_equal(tr.ids, ranked_topk(logits, K))
    with pytest.raises(ValueError, match="cannot write"):
        export_trace(router, {"expert_log": tmp_path / "x.log"})


def trace_config(tmp_path, **model) -> dict:
    cfg = mcfg.load_config("tests/config/config.yaml")
    cfg["models"] = {"embedded": {"embedded": True}, "t": model}
    return cfg


def test_config_checks_at_parse_time(tmp_path, logits, monkeypatch):
    good = write_trace(tmp_path / "t.rtrace01", "rtrace01", logits=logits)
    cfg = trace_config(tmp_path, trace=str(good), top_k=K)
    assert mcfg.model_geometry(cfg, "t") == (E, K)
    cases = [
        ({"trace": str(tmp_path / "none.rtrace01")}, FileNotFoundError, "models.t.trace: trace"),
        ({"trace": str(good)}, ValueError, "models.t.top_k: required for an RTRACE01"),
        ({"trace": str(good), "top_k": 3, "num_experts": 8}, TraceFormatError, "num_experts=8"),
        ({"trace": "results/nope/capture/eval.rtrace01"}, ValueError, "not a captured model"),
    ]
    for model, error, message in cases:
        with pytest.raises(error, match=message):
            mcfg.model_geometry(trace_config(tmp_path, **model), "t")
    bad = tmp_path / "bad.rtrace01"
    bad.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(TraceFormatError, match="truncated"):
        mcfg.model_geometry(trace_config(tmp_path, trace=str(bad), top_k=K), "t")
    # an exported trace takes its source model's geometry; trace keys need a trace model
    cfg = trace_config(tmp_path, trace="results/embedded/capture/eval.rtrace01")
    assert mcfg.model_geometry(cfg, "t") == mcfg.model_geometry(cfg, "embedded")
    assert exported_source("./results/embedded/capture/calib.mblt") == ("embedded", "calib", "mblt")
    cfg["models"]["embedded"]["stream_len"] = 64
    with pytest.raises(ValueError, match="models.embedded: stream_len only apply to a trace"):
        mcfg.check_capacities(cfg)
