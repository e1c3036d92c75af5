"""The regime stage end to end on synthetic captures: skew columns, the designs in both worlds,
the analysis and the report's regime section."""

from __future__ import annotations

from html import unescape
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from moesub.allocation import run_allocation
from moesub.artefacts import router_rows, router_writer
from moesub.capture import run_expert_ranking
from moesub.regime.designs import counterpart, designs_of
from moesub.regime.run import regime_from_captures, run_regime
from moesub.simulate import run_simulate
from moesub.synthetic import SyntheticRouting, synthetic_logits

S, T, L, E, K = 24, 96, 2, 64, 4  # 16 evaluation streams, 8 calibration streams
SIZES = [0.25, 0.375]  # C = 16, 24
POLICIES = {
    "plain": {"rule": "fetch_all", "eviction": "lru"},
    "pins_half": {"rule": "fetch_all", "eviction": "lru", "pin": "50%"},
    "keep_set": {"rule": "first_choice", "eviction": "lru", "pin": "C-k"},
    "pins_8": {"rule": "fetch_all", "eviction": "lru", "pin": 8},
    "planned": {"rule": "fetch_all", "eviction": "lru", "allocation": "planned"},
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
    ranking = root / "expert_ranking.parquet"
    run_expert_ranking(calib, ranking)
    allocations = {"planned": {}}
    for f in SIZES:
        path = root / f"planned_{f}.json"
        run_allocation(calib, ranking, "planned", POLICIES["planned"], f, path)
        allocations["planned"][f"f{f}"] = str(path)
    out = {n: root / f"{n}.parquet" for n in ("regime", "regime_designs")}
    args = dict(sizes=SIZES, policies=POLICIES, allocations=allocations, seed=3)
    run_regime(str(evaluation), str(calib), str(ranking), 0.25, out["regime"],
               root / "regime.json", out["regime_designs"], **args)  # fmt: skip
    return {"eval": evaluation, "calib": calib, "ranking": ranking, "out": out, "args": args,
            "root": root}  # fmt: skip


def test_counterparts():
    assert counterpart(POLICIES["plain"]) is None
    base, change, label = counterpart(POLICIES["pins_half"])
    assert base == POLICIES["plain"] and change == "pins 50%" and label == "no pins"
    base, change, label = counterpart(POLICIES["planned"])
    assert base == POLICIES["plain"] and change == "planned slots" and label == "uniform slots"
    both = {**POLICIES["pins_8"], "allocation": "planned"}
    assert counterpart(both)[1:] == ("pins 8, planned slots", "no pins, uniform slots")
    coact = {"rule": "threshold", "tau": 0.1, "pin": 4, "substitute_by": "coactivation"}
    assert list(designs_of({**POLICIES, "coact": coact})) == [
        "pins_half", "keep_set", "pins_8", "planned"
    ]  # fmt: skip


def test_bad_pin_specs_are_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="policy 'share': pin: 'half' is not a pin spec"):
        missing = tmp_path / "none.parquet"  # never read: the pin is checked first
        regime_from_captures(missing, missing, missing, 0.25, policies={"share": {"pin": "half"}})


def test_planned_design_needs_its_allocations(stage):
    with pytest.raises(ValueError, match=r"design 'planned' is planned .* sizes \['f0.375'\]"):
        regime_from_captures(stage["eval"], stage["calib"], stage["ranking"], 0.25, SIZES,
                             {"planned": POLICIES["planned"]},
                             {"planned": {"f0.25": "unread.json"}})  # fmt: skip


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
    assert d.height == 2 * 4 * 2 * 2  # worlds x designs x roles x sizes
    assert set(d["world"]) == {"evaluation", "skew_matched"}
    assert set(d["size"]) == {"f0.25", "f0.375"}
    # fetch_all: every miss is a fetch; L x k calls per token
    fa = d.filter(pl.col("design") == "pins_half")
    np.testing.assert_allclose(fa["misses_per_token"], L * K * (1 - fa["hit_rate"]))
    np.testing.assert_allclose(fa["fetches_per_token"], fa["misses_per_token"])
    designed = fa.filter(pl.col("role") == "design").sort("world", "size")
    assert designed["pins"].to_list() == ["8", "12"] * 2  # 50% of C = 16, 24
    assert designed["capacities"].to_list() == ["16", "24"] * 2
    keep = d.filter((pl.col("design") == "keep_set") & (pl.col("role") == "design"))
    assert set(keep["pins"]) == {"12", "20"}  # C - k
    planned = d.filter((pl.col("design") == "planned") & (pl.col("role") == "design"))
    for row in planned.iter_rows(named=True):
        caps = [int(c) for c in row["capacities"].split("/")]
        assert len(caps) in (1, L) and sum(caps) * (L // len(caps)) == L * row["capacity"]
    base = d.filter((pl.col("design") == "planned") & (pl.col("role") == "counterpart"))
    assert set(base["capacities"]) == {"16", "24"} and set(base["pins"]) == {"0"}


def test_evaluation_world_replays_as_the_simulate_stage(stage, tmp_path):
    d = pl.read_parquet(stage["out"]["regime_designs"]).filter(pl.col("world") == "evaluation")
    for name in ("keep_set", "pins_half", "planned"):
        for f in SIZES:
            alloc = stage["args"]["allocations"].get(name, {}).get(f"f{f}")
            out = tmp_path / f"{name}_{f}.parquet"
            run_simulate(str(stage["eval"]), str(stage["ranking"]), name, POLICIES[name], f,
                         str(out), str(out.with_suffix(".counts.parquet")),
                         allocation_path=alloc)  # fmt: skip
            sim = pl.read_parquet(out).filter(pl.col("layer") == -1)
            row = d.filter(
                (pl.col("design") == name) & (pl.col("role") == "design")
                & (pl.col("size") == f"f{f}")
            ).row(0, named=True)  # fmt: skip
            assert row["hit_rate"] == sim["hit_rate"][0]


def test_seeded(stage):
    again = regime_from_captures(stage["eval"], stage["calib"], stage["ranking"], 0.25,
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
    assert comparison.height == 4 * 2 and set(comparison["model"]) == {"toy"}
    assert doc["regime"][0]["skew"]["verdict"].startswith("static skew")
    html = unescape(render_report(tmp_path / "an", {}, tmp_path / "r.html").read_text())
    for table in ("regime-table", "skew-table", "regime-designs"):
        assert f'<table id="{table}">' in html
    assert "toy: keep_set at f0.25 (pins C-k over no pins)" in html
    assert "toy: static skew: a layer's 16 hottest experts cover" in html
