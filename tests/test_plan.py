"""moesub.plan: a plan written and read back equal, its pin list read by moesub.traces and
line for line what fitz-tec's own writer makes of the same lists; which choice a plan takes;
bad plans named."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from moesub.artefacts import (
    frequency_sets,
    load_trace,
    router_rows,
    router_writer,
    selection_counts,
)
from moesub.capture import run_expert_ranking
from moesub.plan import (
    build_plan,
    model_identity,
    pins_path,
    read_plan,
    run_plan,
    write_plan,
)
from moesub.report.recommendation import plans_table
from moesub.synthetic import synthetic_logits
from moesub.traces import read_pin_list

E, K, L, C = 32, 4, 3, 8  # MoE layers 1..3 of a 4-layer model (layer 0 dense)
SIZE = {"label": "f0.25", "capacity": C, "fraction": 0.25}
RULE_015 = {"rule": "threshold", "tau": 0.15, "eviction": "lru"}


@pytest.fixture()
def model(tmp_path):
    """A checkpoint's config.json, a calibration capture and its expert ranking."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 4})
    )
    router = tmp_path / "calib_router.parquet"
    meta = {"num_experts": E, "top_k": K, "num_layers": L, "family": "qwen3_next",
            "layer_indices": [1, 2, 3], "norm_topk_prob": True}  # fmt: skip
    with router_writer(router, E, meta, lookahead=False) as w:
        w.write_table(router_rows(0, synthetic_logits(200, L, E, seed=3)))
    ranking = tmp_path / "expert_ranking.parquet"
    run_expert_ranking(router, ranking)
    return {"dir": model_dir, "router": router, "ranking": ranking}


def choice(policy: str, **figures) -> dict:
    return {"policy": policy, "fields": dict(RULE_015), "slots_per_layer": [C] * L,
            "pins_per_layer": [0] * L, "time_per_token_s": 0.01, "tokens_per_s": 100.0,
            "speedup_vs_fetch_every_miss": 2.0, "hit_rate": 0.8, "report_dppl_pct": 0.3,
            "report_dppl_ci_lo": 0.1, "report_dppl_ci_hi": 0.5, "lossless": False,
            **figures}  # fmt: skip


def recommendation(tmp_path, within=None, lossless=None) -> str:
    ranking = {"hardware": "this_machine", "size": "f0.25", "time_source": "simulator",
               "timing": {"method": "none", "text": "simulator estimate"},
               "within_budget": within, "within_budget_reason": "none within 1%",
               "lossless": lossless, "lossless_reason": None}  # fmt: skip
    engine = {**ranking, "time_source": "engine", "within_budget": choice("engine_pick")}
    doc = {"model": "tiny", "dppl_budget_pct": 1.0, "rankings": [engine, ranking],
           "selection": {"screen_streams": [0, 2], "report_streams": [1, 3]}}  # fmt: skip
    path = tmp_path / "recommendation.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_plan_round_trip_from_the_pipeline_artefacts(tmp_path, model):
    rec = recommendation(tmp_path, within=choice("rule_015"))
    out = tmp_path / "plan" / "this_machine" / "f0.25.json"
    plan = run_plan(rec, "tiny", "this_machine", SIZE, model["dir"], str(model["router"]),
                    model["ranking"], out)  # fmt: skip
    assert read_plan(out) == plan
    assert plan.policy_name == "rule_015" and plan.choice == "within_budget"
    assert plan.policy == RULE_015 and plan.hardware == "this_machine"
    m = plan.model
    assert (m.num_experts, m.top_k, m.num_layers, m.num_hidden_layers) == (E, K, L, 4)
    assert m.layer_indices == (1, 2, 3) and len(m.config_sha256) == 64
    # the initial experts: the calibration capture's frequency order, hottest first
    hottest = frequency_sets(selection_counts(load_trace(model["router"])), C)
    assert [list(lp.initial) for lp in plan.layers] == hottest.tolist()
    assert [lp.model_layer for lp in plan.layers] == [1, 2, 3]
    assert plan.predicted["report_dppl_ci_hi"] == 0.5 and plan.predicted["time_lo_s"] is None
    assert plan.pins_file == "f0.25.pins.txt" and pins_path(out).is_file()
    pins = read_pin_list(pins_path(out))
    assert (pins.num_layers, pins.num_experts) == (4, E)
    assert pins.layers == ((),) * 4  # rule_015 pins nothing
    # the report lists the plan (read back) beside the recommendation
    (row,) = plans_table([str(out)]).rows
    assert row[:4] == ["tiny", "this_machine", "f0.25", "rule_015 (within budget)"]
    assert row[4] == f"{C} × {L} layers / none pinned"


def test_pins_read_back_by_moesub_and_written_as_fitz_tec_writes_them(tmp_path, model):
    identity = model_identity("tiny", model["dir"], str(model["router"]))
    ranking = np.stack([np.roll(np.arange(E), -i) for i in range(L)])  # layer i: i, i + 1, ...
    c = choice("pinned", slots_per_layer=[C] * L, pins_per_layer=[2, 0, 3])
    plan = build_plan({"rankings": [_ranking(c)]}, "this_machine", SIZE, identity, ranking,
                      "f0.25.json")  # fmt: skip
    out = tmp_path / "f0.25.json"
    write_plan(plan, out)
    assert read_plan(out) == plan
    assert [lp.pinned for lp in plan.layers] == [(0, 1), (), (2, 3, 4)]
    assert read_pin_list(pins_path(out)).layers == ((), (0, 1), (), (2, 3, 4))
    build = pytest.importorskip(
        "fitz_tec.tools.build_pin_list", reason="fitz-tec (PyPI, dev extra) is not installed"
    )
    theirs = tmp_path / "fitz.pinlist"
    build.emit_pin_list(theirs, 4, E, [[], [0, 1], [], [2, 3, 4]], tmp_path / "trace.bin", K)

    def data_lines(path):  # fitz-tec's llama.cpp skips '#' lines
        return [s for s in path.read_text().splitlines() if not s.startswith("#")]

    assert data_lines(pins_path(out)) == data_lines(theirs)


def _ranking(within, lossless=None) -> dict:
    return {"hardware": "this_machine", "size": "f0.25", "time_source": "simulator",
            "timing": {"text": "t"}, "within_budget": within, "lossless": lossless,
            "within_budget_reason": "none is within"}  # fmt: skip


def test_plan_takes_the_simulator_ranking_else_the_lossless_choice(tmp_path, model):
    identity = model_identity("tiny", model["dir"], str(model["router"]))
    ranking = np.tile(np.arange(E), (L, 1))
    lossless = choice("fetch_every_miss", fields={"rule": "fetch_all"}, lossless=True)
    plan = build_plan({"rankings": [_ranking(None, lossless)]}, "this_machine", SIZE, identity,
                      ranking, "f0.25.json")  # fmt: skip
    assert (plan.choice, plan.policy_name, plan.policy) == (
        "lossless", "fetch_every_miss", {"rule": "fetch_all"},
    )  # fmt: skip
    with pytest.raises(ValueError, match="no policy to run .* none is within"):
        build_plan({"rankings": [_ranking(None)]}, "this_machine", SIZE, identity, ranking,
                   "f0.25.json")  # fmt: skip
    with pytest.raises(ValueError, match="no simulator ranking for hardware 'rtx'"):
        build_plan({"rankings": [_ranking(lossless)]}, "rtx", SIZE, identity, ranking,
                   "f0.25.json")  # fmt: skip
    # a planned layout: each layer starts with its own C_l hottest experts
    c = choice("p", slots_per_layer=[9, 8, 7], pins_per_layer=[1, 0, 0])
    plan = build_plan({"rankings": [_ranking(c)]}, "this_machine", SIZE, identity, ranking,
                      "f0.25.json")  # fmt: skip
    assert [lp.initial for lp in plan.layers] == [tuple(range(n)) for n in (9, 8, 7)]
    assert [lp.pinned for lp in plan.layers] == [(0,), (), ()]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d["model"].update(config_sha256="abc"), "model/config_sha256"),
        (lambda d: d["layers"].pop(), "3 MoE layers, but 2 layer entries"),
        (lambda d: d["layers"][1].update(pinned=[5]), "MoE layer 1: pinned experts must be"),
        (lambda d: d["layers"][0].update(slots=7), "MoE layer 0: 7 slots with 8 initial"),
        (lambda d: d["layers"][2].update(initial=[0] * C), "MoE layer 2: initial experts"),
        (lambda d: d["layers"][0].update(model_layer=0), "MoE layer 0: out of order"),
        (lambda d: d["predicted"].pop("hit_rate"), "'hit_rate' is a required property"),
    ],
)
def test_read_plan_names_what_is_wrong(tmp_path, model, edit, message):
    rec = recommendation(tmp_path, within=choice("rule_015"))
    out = tmp_path / "f0.25.json"
    run_plan(rec, "tiny", "this_machine", SIZE, model["dir"], str(model["router"]),
             model["ranking"], out)  # fmt: skip
    doc = json.loads(out.read_text())
    bad = copy.deepcopy(doc)
    edit(bad)
    out.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=message) as e:
        read_plan(out)
    assert str(out) in str(e.value)
    # a pin list that disagrees with the plan
    doc["layers"][0]["pinned"] = doc["layers"][0]["initial"][:1]
    out.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="does not list its pins"):
        read_plan(out)
