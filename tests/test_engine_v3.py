"""moesub.engine under policy semantics v3 at the driver level: per-layer slot counts, pinned
experts, uploads of host-computed misses (host_admit), per-token-layer counts.

Every v3 policy runs on the disk tier and on the CUDA tier's CPU stand-in (`FakeCuda`, copies
that land late) with unequal per-layer capacities and per-layer initial sets. Under
admission="delay" the decisions and the per-token-layer counts (`TOKEN_LAYER_FIELDS`) are the
core's whole-stream `scan` on the same logits; under either timing every output is the
full-weight reference's, and after every token each pinned slot still holds its pinned expert
(the slot's bytes, not only the core's residency). No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import ACT, CUDA_DEVICES, small_layout, timed_reads, write_random
from test_engine_memory import FakeEvent
from test_engine_overlap import drive_overlap, fake_cuda_tier, lookahead_of

from moesub.engine.copies import BackgroundCopies
from moesub.engine.cuda_tier import CudaTier
from moesub.engine.host_memory import HostExperts
from moesub.engine.runtime import OffloadEngine
from moesub.engine.store import ExpertStore
from moesub.engine.tiers import DiskTier
from moesub.policy import HOST, TOKEN_LAYER_FIELDS, Policy, scan, token_layer_counts
from moesub.synthetic import synthetic_logits

E, K = 16, 4  # drive_overlap's (test_engine_overlap)
CAPS = (8, 9)  # slots of layer 0 and layer 1
FIELD = {name: i for i, name in enumerate(TOKEN_LAYER_FIELDS)}
# the practitioners' designs at CAPS (pin specs resolved per layer by hand), and two more
V3 = {
    # llama.cpp PR #27861: misses on the CPU now, up to two uploads per layer and token
    "llama_cpp_27861": Policy(rule="host_compute", host_admit=2),
    # fitz-tec: half of each layer's slots pinned to its hottest experts
    "fitz_tec_pins": Policy(rule="fetch_all", pin=(4, 4)),
    # a static keep-set: all but k slots pinned, the first choice fetched into a k-slot pool
    "static_keep_set": Policy(rule="first_choice", pin=(4, 5)),
    "quality_pinned": Policy(rule="threshold", tau=0.15, eviction="lfu", beta=0.5, pin=2),
    "hybrid_upload_prefetch": Policy(
        rule="threshold", tau=0.15, light_miss="host", host_admit=1, prefetch=2, pin=(3, 0)
    ),
}


def initial_sets(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(E)[:C].astype(np.int32) for C in CAPS]


def watch_pins(engine, experts):
    """Check at the end of every token that each layer's pinned slots hold the pinned experts'
    weights (the tier's bytes) and that the core still has them there."""
    end_token = engine.end_token

    def checked():
        st = end_token()
        for layer, pin in enumerate(engine.pins):
            pinned = engine.initial[layer][:pin]
            assert np.array_equal(engine.caches[layer].resident()[:pin], pinned)
            slots = engine.tier.slots[layer]
            for slot, e in enumerate(pinned.tolist()):
                gu, dn = experts[layer * E + e]
                assert torch.equal(slots.gate_up[slot].cpu(), gu), (layer, slot)
                assert torch.equal(slots.down[slot].cpu(), dn), (layer, slot)
        return st

    engine.end_token = checked


def check_run(engine, experts, pol, admission, trace, y, lay):
    """Drive the engine (outputs against the full weights, pins watched) and check what it
    counted; under "delay" its decisions and counts are the core's scan."""
    watch_pins(engine, experts)
    try:  # without prefetch the lookahead is never read
        status, ids, stats = drive_overlap(engine, trace, trace if y is None else y, experts,
                                           lay.hidden)  # fmt: skip
        counters = [c.counters() for c in engine.caches]
    finally:
        engine.close()
    counts = np.stack([st.layer_counts for st in stats])  # (T, L, F)
    assert np.array_equal(counts[..., : FIELD["prefetched"]].sum(-1), np.full(counts.shape[:2], K))
    landed = counts[..., FIELD["admissions"]].sum(0)
    assert landed.tolist() == [c["admissions"] for c in counters]
    requested = counts[..., FIELD["admission_requests"]].sum(0)
    assert requested.tolist() == [c["admission_requests"] for c in counters]
    # every landed admission's copy was installed, none other
    assert sum(st.admitted for st in stats) == landed.sum()
    assert sum(st.bytes_bg for st in stats) == landed.sum() * lay.expert_bytes
    if admission == "delay":
        ref = scan(trace, K, CAPS, pol, initial=engine.initial, lookahead=y)
        assert np.array_equal(status, ref.status) and np.array_equal(ids, ref.ids)
        assert np.array_equal(counts, token_layer_counts(ref))
    if pol.host_admit:  # the uploads of host-computed experts really ran
        assert (status == HOST).any() and landed.sum() > 0
        assert (counts[..., FIELD["admission_requests"]] <= pol.host_admit).all()
    return status, counts


@pytest.mark.parametrize("admission", ["delay", "completion"])
@pytest.mark.parametrize("name", list(V3))
def test_disk_engine_runs_v3_policies(tmp_path, name, admission):
    pol = V3[name]
    lay = small_layout(E=E)
    experts = write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    staging = 2 * pol.prefetch + 4
    tier = DiskTier(store, CAPS, K, ACT, staging_buffers=staging)
    assert [s.capacity for s in tier.slots] == list(CAPS)
    engine = OffloadEngine(tier, E, K, CAPS, pol, initial_sets(), ACT, admission=admission)
    trace = synthetic_logits(60, lay.num_layers, E, seed=3)
    y = lookahead_of(trace) if pol.prefetch else None
    check_run(engine, experts, pol, admission, trace, y, lay)
    assert tier.reader._free.qsize() == staging  # landed copies held at the end given back


@pytest.mark.parametrize("lag", [0, 3], ids=["instant", "lagging"])
@pytest.mark.parametrize("pinned_layers", [2, 0])
@pytest.mark.parametrize("admission", ["delay", "completion"])
@pytest.mark.parametrize("name", ["llama_cpp_27861", "static_keep_set", "hybrid_upload_prefetch"])
def test_cuda_tier_runs_v3_policies_on_a_fake_device(tmp_path, monkeypatch, name, admission,
                                                     pinned_layers, lag):  # fmt: skip
    """The CUDA tier's code path (per-layer slot arrays on the device, uploads from pinned
    memory on the side stream, or read by the I/O thread for layers on disk) on the CPU
    stand-in whose copies land late."""
    monkeypatch.setattr(FakeEvent, "lag", lag)
    pol = V3[name]
    tier, experts, lay = fake_cuda_tier(tmp_path, CAPS, pinned_layers)
    engine = OffloadEngine(tier, E, K, CAPS, pol, initial_sets(), ACT, admission=admission)
    trace = synthetic_logits(50, lay.num_layers, E, seed=6)
    y = lookahead_of(trace, seed=2) if pol.prefetch else None
    check_run(engine, experts, pol, admission, trace, y, lay)
    assert not tier._queued and all(not q for q in tier._inflight)
    assert sorted(tier._free) == list(range(8))


@pytest.mark.cuda
@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("pinned_layers", [2, 0], ids=["pinned", "disk-behind"])
@pytest.mark.parametrize("name", list(V3))
def test_cuda_engine_runs_v3_policies(tmp_path, name, pinned_layers, device):
    """The CUDA tier on a GPU: per-layer slot arrays, pins, uploads on the side stream (from
    pinned memory, or read by the I/O thread into pinned memory first)."""
    pol = V3[name]
    lay = small_layout(E=E)
    experts = write_random(tmp_path / "x.bin", lay)
    host = HostExperts(ExpertStore(tmp_path / "x.bin", expected=lay),
                       pinned_layers * E * lay.expert_bytes)  # fmt: skip
    tier = CudaTier(host, CAPS, torch.device(device), ACT)
    engine = OffloadEngine(tier, E, K, CAPS, pol, initial_sets(), ACT, admission="delay")
    trace = synthetic_logits(50, lay.num_layers, E, seed=6)
    check_run(engine, experts, pol, "delay", trace, lookahead_of(trace) if pol.prefetch else None,
              lay)  # fmt: skip


def assert_no_upload_beside_its_layers_host_reads(reads: list[tuple[str, int, float, float]]):
    """Uploads were read (the I/O thread's reads) and so were the host's experts (every other
    thread's), and no upload read started while a host read of its layer was in flight."""
    host = [(layer, a, b) for name, layer, a, b in reads if name != "moesub-io"]
    uploads = [(layer, a) for name, layer, a, _b in reads if name == "moesub-io"]
    assert host and uploads
    for layer, start in uploads:
        assert not any(lh == layer and a < start < b for lh, a, b in host), (layer, start)


def test_uploads_are_read_by_the_io_thread(tmp_path, monkeypatch):
    """host_admit on the disk tier: the host worker reads and computes each miss, the I/O
    thread reads each upload again into a staging buffer, once the worker has read that layer's
    host experts (no upload read starts while one of the layer's host reads is in flight);
    the decoding thread reads nothing (no synchronous fetch under host_compute) once the slots
    are loaded."""
    pol = V3["llama_cpp_27861"]
    lay = small_layout(E=E)
    experts = write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    engine = OffloadEngine(DiskTier(store, CAPS, K, ACT), E, K, CAPS, pol, initial_sets(), ACT,
                           admission="delay")  # fmt: skip
    reads = timed_reads(monkeypatch, store)
    trace = synthetic_logits(30, lay.num_layers, E, seed=8)
    try:
        _status, _ids, stats = drive_overlap(engine, trace, trace, experts, lay.hidden,
                                             early=False)  # fmt: skip
    finally:
        engine.close()
    readers = [name for name, *_ in reads]
    requested = sum(int(st.layer_counts[:, FIELD["admission_requests"]].sum()) for st in stats)
    assert requested > 0 and readers.count("moesub-io") == requested
    assert sum(n.startswith("moesub-host") for n in readers) > 0
    assert set(readers) <= {"moesub-io"} | {n for n in readers if n.startswith("moesub-host")}
    assert_no_upload_beside_its_layers_host_reads(reads)


def test_cuda_tier_uploads_of_a_disk_layer_follow_the_hosts_reads(tmp_path, monkeypatch):
    """The CUDA tier with its layers on disk (the host reads each miss over the link): an
    upload's read (the I/O thread, disk -> pinned) starts once the host has read that step's
    experts (on the decoding thread, in `host_end`), never while one of its layer's is read."""
    tier, experts, lay = fake_cuda_tier(tmp_path, CAPS, 0)
    assert tier.host_reads_link
    engine = OffloadEngine(tier, E, K, CAPS, V3["llama_cpp_27861"], initial_sets(), ACT,
                           admission="delay")  # fmt: skip
    reads = timed_reads(monkeypatch, tier.host.store)
    trace = synthetic_logits(30, lay.num_layers, E, seed=8)
    try:
        drive_overlap(engine, trace, trace, experts, lay.hidden, early=False)
    finally:
        engine.close()
    assert_no_upload_beside_its_layers_host_reads(reads)


def test_held_uploads_need_their_host_experts(tmp_path):
    """A step whose uploads wait for the host's reads, computed without its host experts, is
    an error that says so (their copies would never start)."""
    pol = V3["llama_cpp_27861"]
    lay = small_layout(E=E)
    write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    engine = OffloadEngine(DiskTier(store, CAPS, K, ACT), E, K, CAPS, pol, initial_sets(), ACT,
                           admission="delay")  # fmt: skip
    trace = synthetic_logits(30, lay.num_layers, E, seed=8)
    try:
        for t in range(len(trace)):
            engine.begin_token()
            s = engine.route(0, trace[t, 0][None])
            if s.admissions.size:
                slot, _host = engine.step_ids(s)
                x = torch.zeros(1, lay.hidden)
                with pytest.raises(RuntimeError, match="uploads wait for the host's reads"):
                    engine.compute(0, x, slot, torch.from_numpy(s.weights).float())
                break
        else:
            pytest.fail("no upload requested")
    finally:
        engine.close()


def test_pinned_slots_are_refused_and_bad_layouts_named(tmp_path):
    write_random(tmp_path / "x.bin", small_layout(E=E))
    store = ExpertStore(tmp_path / "x.bin", expected=small_layout(E=E))
    tier = DiskTier(store, CAPS, K, ACT)
    try:
        copies = BackgroundCopies(tier, lambda landed: None, pins=(4, 0))
        with pytest.raises(RuntimeError, match="slot 3 of layer 0 holds a pinned expert"):
            copies.await_copy(0, 3, 11)
        with pytest.raises(RuntimeError, match="a synchronous fetch: slot 0 of layer 0"):
            copies.filled(0, 0)
        copies.await_copy(0, 4, 11)  # past the pins, and every slot of layer 1
        copies.filled(1, 0)
        with pytest.raises(ValueError, match="pins: 1 values for 2 layers"):
            BackgroundCopies(tier, lambda landed: None, pins=(4,))
        with pytest.raises(ValueError, match=r"the tier holds \[8, 9\] slots per layer"):
            OffloadEngine(tier, E, K, 8, Policy(), None, ACT)
        with pytest.raises(ValueError, match="C=8 in layer 0"):
            OffloadEngine(tier, E, K, CAPS, Policy(pin=(5, 5)), None, ACT)
        with pytest.raises(ValueError, match="4 per-layer sets for 2 layers"):
            OffloadEngine(tier, E, K, CAPS, Policy(), initial_sets() * 2, ACT)
    finally:
        tier.close()
    with pytest.raises(ValueError, match="3 per-layer slot counts for 2 layers"):
        DiskTier(store, (8, 9, 10), K, ACT)


def test_a_new_stream_gives_held_copies_back(tmp_path, monkeypatch):
    """Copies that landed but were not yet applied when a stream ends (admissions held for the
    next token, prefetches whose step has not run) give their staging buffers back at `reset`:
    each stream starts with every buffer free."""
    monkeypatch.setattr(FakeEvent, "lag", 3)
    pol = V3["hybrid_upload_prefetch"]
    tier, experts, lay = fake_cuda_tier(tmp_path, CAPS, None)
    engine = OffloadEngine(tier, E, K, CAPS, pol, initial_sets(), ACT, admission="completion")
    trace = synthetic_logits(30, lay.num_layers, E, seed=6)
    y = lookahead_of(trace, seed=2)
    held = 0
    try:
        for stream in range(3):
            drive_overlap(engine, trace[10 * stream :], y[10 * stream :], experts, lay.hidden)
            held += sum(map(len, engine._held)) + sum(map(len, engine._pf_landed))
            engine.reset()
            assert sorted(tier._free) == list(range(8)), stream
    finally:
        engine.close()
    assert held > 0  # some stream ended with landed copies not yet applied
