"""Hardware profiles (moesub.hardware): derivations, shipped estimates, config errors, and the
engine calibration as `this_machine`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest

from moesub.hardware import (
    PROFILES,
    REFERENCE_DENSE_WEIGHTS_PER_LAYER,
    REFERENCE_HEAD_WEIGHTS,
    STUDY_PROFILE,
    HardwareProfile,
    ModelBytes,
    UnitCosts,
    measured_profile,
    reference_model_bytes,
    this_machine,
)
from moesub.slots import REFERENCE_GEOMETRY

BF16 = reference_model_bytes(16)


def test_expert_bytes_of_the_reference_model():
    assert BF16.expert_bytes == REFERENCE_GEOMETRY.expert_bytes(16) == 6_291_456  # 6 MiB
    assert reference_model_bytes(4.5).expert_bytes == 1_769_472
    assert BF16.dense_bytes_per_layer == 2 * REFERENCE_DENSE_WEIGHTS_PER_LAYER
    assert BF16.head_bytes == 2 * 151_936 * 2048


@pytest.mark.slow
def test_reference_weights_are_qwen3_next_80b_a3b():
    """The constants are counted from transformers' Qwen3NextConfig defaults (the 80B-A3B
    model's) on the meta device: 79.7B weights, 77.3B of them in routed experts. A checkpoint
    with that config has its dense weights counted to the same number by its check."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

    from moesub.models import moe_info

    config = Qwen3NextConfig()
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(config)
    assert (config.num_hidden_layers, config.num_experts) == (48, 512)
    dense = [
        sum(p.numel() for n, p in layer.named_parameters() if not n.startswith("mlp.experts."))
        for layer in model.model.layers
    ]
    assert sum(dense) / len(dense) == REFERENCE_DENSE_WEIGHTS_PER_LAYER
    # what a checkpoint's check records of a checkpoint with this config
    assert moe_info(model).dense_weights_per_layer == REFERENCE_DENSE_WEIGHTS_PER_LAYER
    assert model.lm_head.weight.numel() == REFERENCE_HEAD_WEIGHTS
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert experts == 48 * 512 * REFERENCE_GEOMETRY.expert_bytes(8)  # 8 bits: a byte a weight


def test_a_checkpoints_dense_weights_are_priced(tmp_path):
    """A checkpoint's profiles price each MoE layer's dense work from its weights besides the
    routed experts (attention, router, the dense layer's MLP, norms), as its check records them
    (`moe_info`, on the meta device), in bf16; the experts and the head as `pricing_bytes` gives
    them. A record from before the count is an error naming the rerun."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moesub.config import pricing_bytes
    from moesub.models import moe_info
    from moesub.price import write_profile

    config = Qwen3MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
        num_hidden_layers=3, mlp_only_layers=[0], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "ckpt")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    dense = (
        sum(p.numel() for n, p in model.model.layers.named_parameters() if ".mlp.experts." not in n)
        / 2
    )  # fmt: skip  (two MoE layers)
    record = tmp_path / "checkpoint.json"  # as the model_checkpoint rule writes it
    record.write_text(json.dumps({"path": str(tmp_path / "ckpt"), **moe_info(model).to_dict()}))
    cfg = {"models": {"c": {"path": str(tmp_path / "ckpt")}}}
    spec = PROFILES[STUDY_PROFILE].to_dict()
    out = write_profile(STUDY_PROFILE, spec, None, pricing_bytes(cfg, "c"), tmp_path / "p.json",
                        record)  # fmt: skip
    assert out["model_bytes"]["dense_bytes_per_layer"] == 2 * dense > 0
    assert out["model_bytes"]["expert_bytes"] == pricing_bytes(cfg, "c")["expert_bytes"]
    u = PROFILES[STUDY_PROFILE].price(ModelBytes(**out["model_bytes"]))
    assert out["unit_costs"] == asdict(u)
    assert json.loads((tmp_path / "p.json").read_text()) == out
    without = write_profile(STUDY_PROFILE, spec, None, pricing_bytes(cfg, "c"), tmp_path / "q.json")
    assert without["unit_costs"]["dense_layer_s"] < u.dense_layer_s
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"path": str(tmp_path / "ckpt"), "num_experts": 8}))
    with pytest.raises(ValueError, match="no dense_weights_per_layer.*forcerun model_checkpoint"):
        write_profile(STUDY_PROFILE, spec, None, pricing_bytes(cfg, "c"), tmp_path / "r.json", old)
    assert not (tmp_path / "r.json").exists()


def test_the_study_profile_priced_for_bf16_experts():
    u = PROFILES[STUDY_PROFILE].price(BF16)
    fast = 0.7 * 936e9
    assert u.copy_s == pytest.approx(10e-6 + 6_291_456 / 25e9)  # 262 us
    assert u.expert_s == pytest.approx(6_291_456 / fast)  # 9.6 us
    assert u.host_expert_s == pytest.approx(6_291_456 / (0.8 * 51.2e9))  # DDR-bound: 154 us
    assert u.dense_layer_s == pytest.approx(2 * REFERENCE_DENSE_WEIGHTS_PER_LAYER / fast + 30e-6)
    assert u.token_overhead_s == pytest.approx(2 * REFERENCE_HEAD_WEIGHTS / fast)
    assert u.install_s == pytest.approx(2 * 6_291_456 / fast)  # read and write
    assert u.concurrent_host


def test_shipped_profiles_agree_with_the_published_ratios():
    """docs: on PCIe 4 a host miss from desktop DDR5 costs 2.5-4x less than its copy; on PCIe 5
    the two are about equal; a many-channel server favours the host, capped by its cores."""
    ratio = {n: p.price(BF16).copy_s / p.price(BF16).host_expert_s for n, p in PROFILES.items()}
    assert 2.5 <= ratio["rtx4090_pcie4_ddr5"] <= 4
    assert 0.8 <= ratio["rtx5090_pcie5_ddr5"] <= 1.4
    assert ratio["h100_pcie5_server"] > 2
    assert PROFILES["h100_pcie5_server"].host_Bps == 32 * 10e9
    assert all(p.concurrent_host and p.source == "estimate" for p in PROFILES.values())
    assert len(PROFILES) >= 4 and STUDY_PROFILE in PROFILES


def test_from_dict_round_trip_and_named_errors():
    spec = {k: v for k, v in asdict(PROFILES[STUDY_PROFILE]).items() if k != "name"}
    assert HardwareProfile.from_dict("mine", spec) == HardwareProfile(name="mine", **spec)
    cases = [
        ({"link_bw": 1}, r"hardware\.mine: unknown key\(s\) \['link_bw'\]"),
        ({"fast_memory_Bps": None}, r"hardware\.mine\.fast_memory_Bps=None"),
        ({"link_bandwidth_Bps": "25e9"}, r"hardware\.mine\.link_bandwidth_Bps='25e9'"),
        ({"transfer_latency_s": -1e-6}, r"hardware\.mine\.transfer_latency_s=-1e-06"),
        ({"host_cores": True}, r"hardware\.mine\.host_cores=True"),
        ({"host_core_Bps": None}, r"hardware\.mine: .*host_cores and host_core_Bps together"),
        ({"source": "guess"}, r"hardware\.mine\.source='guess'"),
        ({"concurrent_host": "yes"}, r"hardware\.mine\.concurrent_host='yes'"),
        ({"host_reads_link": 1}, r"hardware\.mine\.host_reads_link=1 must be a bool"),
        ({"host_read_Bps": 0.0}, r"hardware\.mine\.host_read_Bps=0\.0 must be a number > 0"),
        ({"host_step_s": -1e-4}, r"hardware\.mine\.host_step_s=-0\.0001 must be a number >= 0"),
        (
            {"background_start_s": -1e-4},
            r"hardware\.mine\.background_start_s=-0\.0001 must be a number >= 0",
        ),
        ({"description": 3}, r"hardware\.mine\.description: expected a string"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            HardwareProfile.from_dict("mine", {**spec, **change})
    with pytest.raises(ValueError, match=r"hardware\.mine: missing key\(s\) \['host_memory_Bps'\]"):
        HardwareProfile.from_dict("mine", {k: v for k, v in spec.items() if k != "host_memory_Bps"})
    with pytest.raises(ValueError, match=r"hardware\.mine: expected a mapping"):
        HardwareProfile.from_dict("mine", [1, 2])


def test_a_measured_dense_layer_replaces_the_bytes():
    spec = {k: v for k, v in asdict(PROFILES[STUDY_PROFILE]).items() if k != "name"}
    p = HardwareProfile.from_dict("m", {**spec, "dense_layer_s": 1e-4, "token_overhead_s": 2e-4})
    u = p.price(BF16)
    assert u.dense_layer_s == pytest.approx(1e-4 + 30e-6)  # + the layer overhead
    assert u.token_overhead_s == 2e-4  # the head is in the measured dense time


SECONDS = {
    "copy_s": 69e-6,
    "expert_s": 40e-6,
    "host_expert_s": 90e-6,
    "dense_layer_s": 300e-6,
    "token_overhead_s": 1e-3,
    "install_s": 5e-6,
    "host_read_drag": 0.25,  # fractions: priced for any expert size as they are
    "background_read_drag": 0.125,
    "sync_step_s": 150e-6,  # a constant: a step's, whatever its experts' size
    "host_read_s": 52e-6,  # the host's reads, back to back: faster than the copies
    "host_step_s": 200e-6,  # a constant, as the copies' step
    "background_start_s": 300e-6,  # a constant: a batch's, whatever its experts' size
}


def test_this_machine_prices_the_calibrated_model_as_measured(tmp_path):
    profile = measured_profile(SECONDS, 98_304.0, "test calibration")
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"profile": profile.to_dict(), "expert_bytes": 98_304.0}))
    for source in (path, {"profile": profile.to_dict()}):
        p = this_machine(source)
        assert p == profile
        assert (p.name, p.source, p.concurrent_host) == ("this_machine", "measured", False)
        u = p.price(ModelBytes(expert_bytes=98_304.0))
        for key, seconds in SECONDS.items():
            assert getattr(u, key) == pytest.approx(seconds, rel=1e-12), key
    assert not (profile.host_reads_link or u.host_reads_link)  # the default: the host's memory
    disk = measured_profile(SECONDS, 98_304.0, "a disk tier", host_reads_link=True)
    assert this_machine({"profile": disk.to_dict()}) == disk
    assert disk.price(ModelBytes(expert_bytes=98_304.0)).host_reads_link
    # per-expert times scale with the expert's bytes; a term measured as 0 stays free
    free = measured_profile({**SECONDS, "install_s": 0.0}, 98_304.0, "free installs")
    u = free.price(ModelBytes(2 * 98_304.0))
    assert u.expert_s == pytest.approx(80e-6) and u.install_s == 0.0
    assert (u.host_read_drag, u.background_read_drag) == (0.25, 0.125)
    assert (u.sync_step_s, u.host_step_s, u.background_start_s) == (150e-6, 200e-6, 300e-6)
    assert u.host_read_s == pytest.approx(104e-6)  # a rate, as the copies
    assert math.isinf(free.install_Bps)
    # a profile without a rate for the host's reads: a copy's, now and after the copy moves
    as_copy = PROFILES[STUDY_PROFILE]
    assert as_copy.host_read_Bps is None
    u = as_copy.price(ModelBytes(expert_bytes=98_304.0))
    assert u.host_read_s is None and u.host_read_each_s == u.copy_s
    assert replace(u, copy_s=1e-3).host_read_each_s == 1e-3


def test_this_machine_names_a_bad_calibration():
    with pytest.raises(ValueError, match=r"missing unit cost\(s\) \['install_s'\]"):
        measured_profile({k: v for k, v in SECONDS.items() if k != "install_s"}, 1.0, "x")
    with pytest.raises(ValueError, match=r"hardware\.this_machine\.expert_s=-1"):
        measured_profile({**SECONDS, "expert_s": -1}, 1.0, "x")
    for drag in ("host_read_drag", "background_read_drag", "sync_step_s", "host_read_s",
                 "host_step_s", "background_start_s"):  # fmt: skip
        with pytest.raises(ValueError, match=rf"hardware\.this_machine\.{drag}=-0\.1"):
            measured_profile({**SECONDS, drag: -0.1}, 1.0, "x")
    with pytest.raises(ValueError, match="no `profile`"):
        this_machine({"link_bandwidth_Bps": 1e9})
    bad = {**measured_profile(SECONDS, 1.0, "x").to_dict(), "dense_layer_s": -1.0}
    with pytest.raises(ValueError, match=r"calibration: hardware\.this_machine\.dense_layer_s"):
        this_machine({"profile": bad})


def test_bad_model_bytes_and_unit_costs():
    with pytest.raises(ValueError, match="expert_bytes=0"):
        ModelBytes(expert_bytes=0)
    with pytest.raises(ValueError, match="head_bytes=-1"):
        ModelBytes(expert_bytes=1, head_bytes=-1)
    with pytest.raises(ValueError, match="copy_s=nan"):
        UnitCosts(math.nan, 0, 0, 0, 0, 0, True)
