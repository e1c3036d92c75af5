"""The regime stage end to end on synthetic captures: skew columns, the designs in both worlds,
the analysis and the report's regime section."""

from __future__ import annotations

from html import unescape
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from moesub.artefacts import load_trace, read_initial_set, router_rows, router_writer
from moesub.capture import write_initial_sets
from moesub.grid import GridPoint, simulate
from moesub.policy import Policy
from moesub.regime.designs import counterpart, designs_of
from moesub.regime.run import regime_from_captures, run_regime
from moesub.synthetic import SyntheticRouting, synthetic_logits

S, T, L, E, K = 24, 96, 2, 64, 4  # 16 evaluation streams, 8 calibration streams
POLICIES = {
    "plain": {"rule": "fetch_all", "eviction": "lru"},
    "pins_half": {"rule": "fetch_all", "eviction": "lru", "pin": 8},  # half of C = 16
    "keep_set": {"rule": "first_choice", "eviction": "lru", "pin": 12},  # C - k
    "pins_per_layer": {"rule": "fetch_all", "eviction": "lru", "pin": [4, 0]},
}  # fmt: skip


def _write(path: Path, streams: list[np.ndarray]) -> Path:
    meta = {"num_experts": E, "top_k": K, "num_layers": L, "norm_topk_prob": True}
    meta |= {"model": "synthetic", "family": "qwen3_next", "layer_indices": [0, 1]}
    with router_writer(path, E, meta | {"dtype": "float32"}, lookahead=False) as w:
        for s, z in enumerate(streams):
            w.write_table(router_rows(s, z))
    return path


@pytest.fixture(scope="module")
def stage(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("regime_stage")
    z = synthetic_logits(S * T, L, E, seed=7, routing=SyntheticRouting(popularity_scale=1.2))
    streams = list(z.reshape(S, T, L, E))
    evaluation = _write(root / "eval.parquet", streams[:16])
    calib = _write(root / "calib.parquet", streams[16:])
    initial_sets = root / "initial_sets.parquet"
    write_initial_sets(calib, [0.25], initial_sets)
    out = {n: root / f"{n}.parquet" for n in ("regime", "regime_designs")}
    args = dict(fractions=[0.25], policies=POLICIES, seed=3)
    run_regime(str(evaluation), str(calib), str(initial_sets), 0.25, out["regime"],
               root / "regime.json", out["regime_designs"], **args)  # fmt: skip
    return {"eval": evaluation, "calib": calib, "initial_sets": initial_sets, "out": out,
            "args": args}  # fmt: skip


def test_counterparts():
    assert counterpart(POLICIES["plain"]) is None
    base, change, label = counterpart(POLICIES["pins_half"])
    assert base == POLICIES["plain"] and change == "pins 8" and label == "no pins"
    assert counterpart(POLICIES["pins_per_layer"])[1] == "pins 4/0"
    coact = {"rule": "threshold", "tau": 0.1, "pin": 4, "substitute_by": "coactivation"}
    assert list(designs_of({**POLICIES, "coact": coact})) == [
        "pins_half", "keep_set", "pins_per_layer"
    ]  # fmt: skip


def test_pin_specs_are_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="policy 'share': pin '50%'.*integer pins only"):
        missing = tmp_path / "none.parquet"  # never read: the pin is checked first
        regime_from_captures(missing, missing, missing, policies={"share": {"pin": "50%"}})


def test_skew_columns(stage):
    layers = pl.read_parquet(stage["out"]["regime"])
    assert layers["layer"].to_list() == [0, 1, -1]
    real = layers.filter(pl.col("layer") >= 0)
    np.testing.assert_allclose(
        real["matched_effective_experts"], real["real_effective_experts"], rtol=0.05
    )
    assert (real["top_coverage"] > real["matched_top_coverage"] + 0.1).all()
    assert (real["initial_coverage"] > real["matched_initial_coverage"]).all()
    assert "top_coverage_f0.25" in layers.columns
    np.testing.assert_allclose(real["real_top_coverage"], [0.57, 0.6], atol=0.03)


def test_designs_in_both_worlds(stage):
    d = pl.read_parquet(stage["out"]["regime_designs"])
    assert d.height == 2 * 3 * 2  # worlds x designs x roles at one size
    assert set(d["world"]) == {"evaluation", "skew_matched"}
    # fetch_all: every miss is a fetch; L x k calls per token
    fa = d.filter(pl.col("design") == "pins_half")
    np.testing.assert_allclose(fa["misses_per_token"], L * K * (1 - fa["hit_rate"]))
    np.testing.assert_allclose(fa["fetches_per_token"], fa["misses_per_token"])
    assert set(fa["pins"]) == {"8", "0"} and set(fa["capacities"]) == {"16"}
    assert set(d.filter(pl.col("design") == "pins_per_layer")["pins"]) == {"4/0", "0"}


def test_evaluation_world_replays_as_the_simulate_stage(stage):
    d = pl.read_parquet(stage["out"]["regime_designs"]).filter(pl.col("world") == "evaluation")
    trace = load_trace(stage["eval"])
    initial = read_initial_set(stage["initial_sets"], 0.25)
    for name in ("keep_set", "pins_per_layer"):
        point = GridPoint(name, Policy.from_dict(POLICIES[name]), 16, initial, 0.25)
        sim = simulate(trace.logits, K, [point], belady=False).filter(pl.col("layer") == -1)
        row = d.filter((pl.col("design") == name) & (pl.col("role") == "design")).row(0, named=True)
        assert row["hit_rate"] == sim["hit_rate"][0]


def test_seeded(stage):
    again = regime_from_captures(stage["eval"], stage["calib"], stage["initial_sets"], 0.25,
                                 **stage["args"])  # fmt: skip
    assert again.designs.equals(pl.read_parquet(stage["out"]["regime_designs"]))
    assert again.regime.summary["skew"]["seed"] == 3


def test_analysis_and_report(stage, tmp_path):
    from moesub.report import render_report
    from moesub.stats import run_analysis

    model_dir = tmp_path / "results" / "toy"
    model_dir.mkdir(parents=True)
    for name, path in stage["out"].items():
        (model_dir / f"{name}.parquet").write_bytes(path.read_bytes())
    inputs = {n: [str(model_dir / f"{n}.parquet")] for n in stage["out"]}
    doc = run_analysis(inputs, {"policies": {}}, tmp_path / "an")
    comparison = pl.read_parquet(tmp_path / "an" / "regime_designs.parquet")
    assert comparison.height == 3 and set(comparison["model"]) == {"toy"}
    assert doc["regime"][0]["skew"]["verdict"].startswith("static skew")
    html = unescape(render_report(tmp_path / "an", {}, tmp_path / "r.html").read_text())
    for table in ("regime-table", "skew-table", "regime-designs"):
        assert f'<table id="{table}">' in html
    assert "toy: keep_set at f0.25 (pins 12 over no pins)" in html
    assert "toy: static skew: a layer's 16 hottest experts cover" in html
