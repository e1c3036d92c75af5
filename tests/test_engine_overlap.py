"""moesub.engine's overlap: speculative prefetch from lookahead logits (issued one MoE layer early,
copied in the background, installed into the slots the core's step 1b chose), the host's
experts on a worker thread beside the slot kernels, and the per-token measurements.

Decisions are held to the policy core's whole-stream `scan` on the same logits and lookahead
(token for token), outputs to a full-weight reference; the CUDA tier runs on the CPU stand-in
(`FakeCuda`, whose events complete late: prefetch copies that are not there when needed).
No timing is asserted: only what was copied, installed, counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine import ACT, reference, small_layout, write_random
from test_engine_memory import FakeCuda, FakeEvent

from moesub.engine.cuda_tier import CudaTier
from moesub.engine.host_memory import CountingAllocator, HostExperts
from moesub.engine.runtime import HostInputs, OffloadEngine, TokenStats, top_n
from moesub.engine.store import ExpertStore
from moesub.engine.tiers import DiskTier
from moesub.policy import HOST, Policy, scan
from moesub.synthetic import synthetic_logits

E, K, C = 16, 4, 6


def lookahead_of(trace: np.ndarray, seed: int = 1, noise: float = 0.7) -> np.ndarray:
    """Lookahead logits that mostly, not always, foresee the trace's top-k."""
    rng = np.random.default_rng(seed)
    return (trace + noise * rng.standard_normal(trace.shape)).astype(np.float32)


def drive_overlap(engine, trace, lookahead, experts, hidden_dim, early=True, seed=0):
    """The model's order of calls: layer l+1's prefetch is issued before layer l's step (the
    tap on layer l's pre-MoE norm), layer 0's at the start of the token; `early=False` hands
    the lookahead to `route` instead. Outputs (on the tier's device) checked against the full
    weights; returns the statuses, computed ids (T, L, k) and the per-token stats."""
    g = torch.Generator().manual_seed(seed)
    T, L, _ = trace.shape
    status, ids, stats = np.zeros((T, L, K), np.int8), np.zeros((T, L, K), np.int32), []
    for t in range(T):
        engine.begin_token()
        if early:
            engine.prefetch(0, lookahead[t, 0][None])
        for layer in range(L):
            if early and layer + 1 < L:
                engine.prefetch(layer + 1, lookahead[t, layer + 1][None])
            x = torch.randn(1, hidden_dim, generator=g)
            y_row = None if early else lookahead[t, layer][None]
            s = engine.route(layer, trace[t, layer][None], lookahead=y_row)
            slot, host_ids = engine.step_ids(s)
            w = torch.from_numpy(s.weights).float()
            host = None if host_ids is None else HostInputs(host_ids, x, w)
            dev = engine.tier.slots[layer].gate_up.device  # the host's inputs stay on the host
            out = engine.compute(layer, x.to(dev), slot, w.to(dev), host)
            ref = reference(x, s.ids, s.weights, experts, layer, E)
            torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)
            status[t, layer], ids[t, layer] = s.status[0], s.ids[0]
        stats.append(engine.end_token())
    return status, ids, stats


def disk_engine(tmp_path, policy, admission, staging=None):
    lay = small_layout(E=E)
    experts = write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    tier = DiskTier(store, C, K, ACT, staging_buffers=staging)
    return OffloadEngine(tier, E, K, C, policy, None, ACT, admission=admission), experts, lay


def fake_cuda_tier(tmp_path, capacity, pinned_layers: int | None):
    """The CUDA tier on the CPU stand-in (8 staging buffers) over a random store of E experts:
    `pinned_layers` layers in (counted) pinned memory, the others on disk (None: all pinned).
    Returns (tier, experts, layout)."""
    lay = small_layout(E=E)
    experts = write_random(tmp_path / "x.bin", lay)
    budget = None if pinned_layers is None else pinned_layers * E * lay.expert_bytes
    host = HostExperts(ExpertStore(tmp_path / "x.bin", expected=lay), budget, CountingAllocator())
    cuda = FakeCuda()
    return CudaTier(host, capacity, "cpu", ACT, 8, alloc=host.alloc, cuda=cuda), experts, lay


POLICIES = {
    "fetch_prefetch2": Policy(rule="fetch_all", prefetch=2),
    "threshold_prefetch3": Policy(rule="threshold", tau=0.2, prefetch=3),
    "admission_prefetch2": Policy(rule="first_choice", eviction="lfu", beta=0.5, prefetch=2),
    "host_light_prefetch1": Policy(rule="first_choice", light_miss="host", prefetch=1),
    "host_compute": Policy(rule="host_compute"),
}


@pytest.mark.parametrize("admission", ["delay", "completion"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_disk_prefetch_decisions_equal_the_core(tmp_path, name, admission):
    """Prefetch issued a layer early, copied by the I/O thread: every step's decisions are the
    core's scan on the same logits and lookahead (admissions under "delay"; without admission
    both timings decide alike), and every output the full-weight reference's."""
    pol = POLICIES[name]
    engine, experts, lay = disk_engine(tmp_path, pol, admission, staging=2 * pol.prefetch + 4)
    trace = synthetic_logits(50, lay.num_layers, E, seed=3)
    y = lookahead_of(trace)
    try:
        status, ids, stats = drive_overlap(engine, trace, y, experts, lay.hidden)
        counters = [c.counters() for c in engine.caches]
    finally:
        engine.close()
    if pol.beta == 0 or admission == "delay":
        ref = scan(trace, K, C, pol, lookahead=y if pol.prefetch else None)
        assert np.array_equal(status, ref.status) and np.array_equal(ids, ref.ids)
        assert sum(s.prefetches for s in stats) == int(ref.prefetched.sum())
    issued = sum(s.prefetches for s in stats)
    assert issued == sum(c["prefetches"] for c in counters)
    assert sum(s.prefetch_in_time for s in stats) <= issued
    if pol.prefetch:
        assert issued > 0
        # every prefetch copy was installed or dropped (its expert evicted before it landed)
        installed = sum(s.bytes_prefetch for s in stats) // lay.expert_bytes
        assert 0 < installed <= issued
    if (status == HOST).any():
        assert sum(s.bytes_host for s in stats) > 0


def test_prefetch_given_to_route_equals_prefetch_issued_early(tmp_path):
    """The lookahead handed to `route` (no overlap) decides exactly as a prefetch issued one
    layer early."""
    pol = POLICIES["threshold_prefetch3"]
    runs = []
    for early in (True, False):
        engine, experts, lay = disk_engine(tmp_path / str(early), pol, "delay", staging=10)
        trace = synthetic_logits(30, lay.num_layers, E, seed=4)
        try:
            runs.append(drive_overlap(engine, trace, lookahead_of(trace), experts, lay.hidden,
                                      early=early)[:2])  # fmt: skip
        finally:
            engine.close()
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("lag", [0, 4], ids=["instant", "lagging"])
@pytest.mark.parametrize("pinned_layers", [2, 0])
@pytest.mark.parametrize("admission", ["delay", "completion"])
@pytest.mark.parametrize("name", ["fetch_prefetch2", "admission_prefetch2", "host_light_prefetch1"])
def test_cuda_prefetch_on_a_fake_device(tmp_path, monkeypatch, name, admission, pinned_layers,
                                        lag):  # fmt: skip
    """The CUDA tier's prefetch (pinned layers, and layers on disk through the I/O thread)
    on the CPU stand-in whose copies complete late: under "completion" a computed expert whose
    copy has not landed is waited for (late), the others are installed when they land; the
    decisions are the core's, the outputs the reference's."""
    monkeypatch.setattr(FakeEvent, "lag", lag)
    pol = POLICIES[name]
    tier, experts, lay = fake_cuda_tier(tmp_path, C, pinned_layers)
    cuda = tier.cuda
    engine = OffloadEngine(tier, E, K, C, pol, None, ACT, admission=admission)
    trace = synthetic_logits(40, lay.num_layers, E, seed=6)
    y = lookahead_of(trace, seed=2)
    try:
        device_syncs = cuda.device_syncs
        status, ids, stats = drive_overlap(engine, trace, y, experts, lay.hidden)
        assert cuda.device_syncs == device_syncs  # never the whole device within tokens
    finally:
        engine.close()
    if pol.beta == 0 or admission == "delay":
        ref = scan(trace, K, C, pol, lookahead=y)
        assert np.array_equal(status, ref.status) and np.array_equal(ids, ref.ids)
    issued = sum(s.prefetches for s in stats)
    in_time = sum(s.prefetch_in_time for s in stats)
    assert issued > 0 and in_time <= issued
    if lag and pinned_layers == 2:  # every copy needs `lag` polls: some land after the step
        assert in_time < issued
    assert not tier._queued and all(not q for q in tier._inflight)  # drained on close
    assert sorted(tier._free) == list(range(8))


def test_late_prefetch_is_waited_for_only_when_computed(tmp_path, monkeypatch):
    """admission="completion" on copies that land late: the step does not wait for them; a
    slot whose copy is still on its way is never read (the output would differ from the
    reference) and is filled once the copy lands (the next token, or when computed)."""
    monkeypatch.setattr(FakeEvent, "lag", 50)  # far later than the step
    pol = Policy(rule="fetch_all", prefetch=3)
    tier, experts, lay = fake_cuda_tier(tmp_path, C, None)
    engine = OffloadEngine(tier, E, K, C, pol, None, ACT, admission="completion")
    trace = synthetic_logits(20, lay.num_layers, E, seed=7)
    try:
        _status, _ids, stats = drive_overlap(engine, trace, lookahead_of(trace, noise=0.2),
                                             experts, lay.hidden)  # fmt: skip
    finally:
        engine.close()
    # copies take 50 polls: most land after their step
    assert sum(s.prefetch_in_time for s in stats) < sum(s.prefetches for s in stats) / 2
    assert sum(s.bytes_prefetch for s in stats) > 0  # but they were installed eventually
    assert sum(s.prefetch_wait_s > 0 for s in stats) > 0  # some were computed: waited for


def test_host_experts_are_read_beside_the_slot_kernels(tmp_path, monkeypatch):
    """light_miss='host' on the disk tier: the host's experts are read on the worker thread
    while the main thread computes the slots', and computed by the main thread after them (one
    processor, one OpenMP team); the layer's output is both together."""
    import threading

    pol = Policy(rule="first_choice", light_miss="host")
    engine, experts, lay = disk_engine(tmp_path, pol, "delay")
    threads: set[str] = set()
    computed_on: set[str] = set()
    real_read, real_end = engine.tier.host_read, engine.tier.host_end

    def host_read(*args):
        threads.add(threading.current_thread().name)
        return real_read(*args)

    def host_end(job):
        computed_on.add(threading.current_thread().name)
        return real_end(job)

    monkeypatch.setattr(engine.tier, "host_read", host_read)
    monkeypatch.setattr(engine.tier, "host_end", host_end)
    trace = synthetic_logits(20, lay.num_layers, E, seed=8)
    try:
        status, _ids, stats = drive_overlap(engine, trace, trace, experts, lay.hidden, early=False)
    finally:
        engine.close()
    assert (status == HOST).any()
    assert threads and all(n.startswith("moesub-host") for n in threads)
    assert computed_on == {threading.current_thread().name}
    assert sum(s.bytes_host for s in stats) == lay.expert_bytes * sum(
        len(np.unique(row[st == HOST])) for rows, sts in zip(_ids, status, strict=True)
        for row, st in zip(rows, sts, strict=True)
    )  # fmt: skip


def test_prefetch_errors(tmp_path):
    pol = Policy(rule="fetch_all", prefetch=2)
    engine, _experts, lay = disk_engine(tmp_path, pol, "delay")
    z = synthetic_logits(1, 1, E, seed=0)[:, 0]
    try:
        engine.begin_token()
        with pytest.raises(ValueError, match="needs layer 0's lookahead"):
            engine.route(0, z)
        with pytest.raises(ValueError, match="shape"):
            engine.prefetch(0, np.zeros((1, E + 1), np.float32))
        with pytest.raises(ValueError, match="NaN"):
            engine.prefetch(0, np.full((1, E), np.nan, np.float32))
        engine.prefetch(0, z)
        with pytest.raises(RuntimeError, match="twice"):
            engine.prefetch(0, z)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="exceeds the capacity"):
        OffloadEngine(engine.tier, E, K, C, Policy(prefetch=C + 1), None, ACT)
    assert list(top_n(np.array([1.0, 3.0, 3.0, 2.0], np.float32), 3)) == [1, 2, 3]
    assert TokenStats().prefetches == 0


def test_expert_runs_read_nearby_experts_together(monkeypatch):
    """Prefill and slot loading read experts in runs: ids within RUN_GAP_BYTES of each other
    in one read, never more than RUN_BYTES at once."""
    from moesub.engine import tiers

    monkeypatch.setattr(tiers, "RUN_GAP_BYTES", 2 * 100)
    monkeypatch.setattr(tiers, "RUN_BYTES", 6 * 100)
    runs = tiers.expert_runs(np.array([0, 1, 3, 6, 7, 8, 20]), stride=100)
    # 1 -> 3 leaves one unused expert (merged); adding 6 would make the run 700 B > 600 (a new
    # run); 8 -> 20 leaves 1100 B unused (a new run)
    assert runs == [(0, [0, 1, 3]), (6, [6, 7, 8]), (20, [20])]
    assert tiers.expert_runs(np.array([], np.int64), 100) == []
