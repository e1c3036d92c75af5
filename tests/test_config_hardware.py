"""The `hardware:` config section: profiles priced, the user's own profiles, errors naming
`hardware.<name>.<key>`, and numbers YAML 1.1 reads as strings (`25e9`)."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from moesub.config import (
    load_config,
    priced_hardware,
    pricing_bytes,
    pricing_geometry,
    profile_spec,
    user_profiles,
)
from moesub.config.validation import validate_config
from moesub.hardware import SHIPPED, THIS_MACHINE, reference_model_bytes

BASE = """
models: {m: {embedded: true}}
streams: {source: {kind: embedded}}
fractions: [0.25]
policies: {fetch_every_miss: {rule: fetch_all}}
"""
MINE = """
hardware:
  mine:
    description: my desktop
    source: estimate
    concurrent_host: true
    link_bandwidth_Bps: 25e9
    transfer_latency_s: 1e-5
    fast_memory_Bps: 6.0e+11
    host_memory_Bps: 60000000000
"""


def config(text: str = MINE) -> dict:
    return yaml.safe_load(BASE + text)


def test_yaml_11_exponents_are_numbers():
    raw = config()
    assert raw["hardware"]["mine"]["link_bandwidth_Bps"] == "25e9"  # what PyYAML reads
    cfg = validate_config(raw)
    mine = cfg["hardware"]["mine"]
    assert mine["link_bandwidth_Bps"] == 25e9 and mine["transfer_latency_s"] == 1e-5
    assert (mine["token_overhead_s"], mine["layer_overhead_s"]) == (0.0, 0.0)  # defaults
    # anywhere the schema takes a number, not only in profiles; never where it takes a string
    cfg = validate_config(yaml.safe_load(BASE + "embedded: {lr: 2e-3}\nrecommend: {}\n"))
    assert cfg["embedded"]["lr"] == 2e-3
    named = validate_config(yaml.safe_load(BASE.replace("m: {embedded", "1e5: {embedded")))
    assert "1e5" in named["models"]


def test_priced_profiles_default_to_every_one_known():
    cfg = validate_config(config())
    assert priced_hardware(cfg) == [THIS_MACHINE, *SHIPPED, "mine"]
    assert profile_spec(cfg, THIS_MACHINE) is None
    assert profile_spec(cfg, "rtx3090_pcie4_ddr4") == SHIPPED["rtx3090_pcie4_ddr4"]
    assert user_profiles(cfg)["mine"].link_bandwidth_Bps == 25e9
    cfg["hardware"]["price"] = ["mine", THIS_MACHINE]
    assert priced_hardware(cfg) == ["mine", THIS_MACHINE]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h["mine"].update(link_bw=1), r"hardware\.mine\.link_bw: unknown key"),
        (lambda h: h["mine"].pop("fast_memory_Bps"), r"hardware\.mine\.fast_memory_Bps: missing"),
        (lambda h: h["mine"].update(host_memory_Bps=-1), r"hardware\.mine\.host_memory_Bps: -1"),
        (lambda h: h["mine"].update(source="guess"), r"hardware\.mine\.source: 'guess'"),
        (lambda h: h["mine"].update(concurrent_host="yes"), r"hardware\.mine\.concurrent_host"),
        (lambda h: h["mine"].update(link_bandwidth_Bps="fast"), r"link_bandwidth_Bps: 'fast'"),
        (lambda h: h.update(price=[]), r"hardware\.price: \[\] is not allowed"),
    ],
)
def test_schema_errors_name_the_key(change, message):
    cfg = config()
    change(cfg["hardware"])
    with pytest.raises(ValueError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h["mine"].update(host_cores=8), r"hardware\.mine: give host_cores and "),
        (lambda h: h.update(price=[THIS_MACHINE, "yours"]), r"hardware\.price\[1\]: unknown "),
        (lambda h: h.update(rtx3090_pcie4_ddr4=h["mine"]), r"rtx3090_pcie4_ddr4: .*shipped"),
        (lambda h: h.update(this_machine=h["mine"]), r"this_machine: .*calibration"),
    ],
)
def test_profile_errors_name_the_key_at_parse_time(change, message, tmp_path):
    cfg = config()
    change(cfg["hardware"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(copy.deepcopy(cfg)))
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_models_are_priced_at_their_pricing_geometry_and_expert_bits(tmp_path):
    """The profiles price an expert as the budgets do (pricing geometry x expert_bits): the
    embedded model as the reference model, a checkpoint by its config.json, its own
    expert_bits over the top-level one; dense weights and the head stay bf16."""
    cfg = {"models": {"e": {"embedded": True}}, "expert_bits": 4.5}
    assert pricing_bytes(cfg, "e") == {
        "expert_bytes": 1_769_472.0,  # 3 x 2048 x 512 x 4.5 / 8
        "dense_bytes_per_layer": reference_model_bytes(16).dense_bytes_per_layer,
        "head_bytes": reference_model_bytes(16).head_bytes,
    }
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "hidden_size": 64,
        "moe_intermediate_size": 32, "vocab_size": 100,
    }))  # fmt: skip
    cfg["models"]["c"] = {"path": str(ckpt), "expert_bits": 8}
    got = pricing_bytes(cfg, "c")
    assert got["expert_bytes"] == pricing_geometry(cfg, "c").expert_bytes(8) == 3 * 64 * 32
    assert (got["dense_bytes_per_layer"], got["head_bytes"]) == (0.0, 100 * 64 * 2)
