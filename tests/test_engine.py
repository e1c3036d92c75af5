"""moesub.engine: the expert store (O_DIRECT / fadvise reads, faults), the engine driver against
the policy core and a full-weight reference, background admission, the decode loop's NLL against
the capture, the real-size benchmark's table (tiny shapes here), calibration, and the CUDA tier
(`-m cuda`, skipped without a GPU)."""

from __future__ import annotations

import copy
import ctypes
import importlib
import importlib.util
import json
import math
import mmap
import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
import torch
from tiny_models import random_streams, tiny_qwen3_next

import moesub.engine.store
import moesub.engine.tiers
import moesub.models
import moesub.price
import moesub.run_speed
from moesub.artefacts import layout_for, load_trace
from moesub.calibration import run_errors
from moesub.capture import run_capture, run_expert_ranking
from moesub.engine import (
    BenchParams,
    ExpertStore,
    StoreLayout,
    calibrate,
    measure_read_bandwidth,
    run_benchmark,
    run_engine,
    run_engine_stage,
    summarize_engine,
    write_store,
)
from moesub.engine.bench_runs import read_bench_counts
from moesub.engine.calibrate import MECHANISMS, MICRO_RUNS, Calibration, round_order, spread
from moesub.engine.cuda_tier import CudaTier
from moesub.engine.generate import EngineModel
from moesub.engine.host_memory import HostExperts
from moesub.engine.kernels import choose_path, expert_forward
from moesub.engine.microbench import (
    measure_background_read_drag,
    measure_expert_compute,
    measure_host_read_drag,
    measure_install,
)
from moesub.engine.runtime import HostInputs, OffloadEngine
from moesub.engine.stage import ROW_COLUMNS, PolicyRun
from moesub.engine.store import aligned_empty, open_or_write_store, random_experts
from moesub.engine.tiers import DiskTier, SlotImage, require_cuda
from moesub.hardware import THIS_MACHINE, HardwareProfile, ModelBytes, UnitCosts, this_machine
from moesub.io import read_metadata, write_parquet
from moesub.policy import (
    ALL_RESIDENT,
    FETCH,
    HOST,
    STATUS_NAMES,
    STUDY_POLICIES,
    SUB,
    TOKEN_LAYER_FIELDS,
    Policy,
    capacity_for,
    scan,
    token_layer_counts,
)
from moesub.price import costs_at_run_disk, run_price, write_profile
from moesub.pricing import price_streams
from moesub.run_speed import (
    AtRunDisk,
    DiskClock,
    costs_at_speed,
    engine_jackknife,
    reference_clock,
    speed_probe,
)
from moesub.synthetic import synthetic_logits
from moesub.token_counts import stream_counts

ACT = torch.nn.functional.silu
HAS_CUDA = torch.cuda.is_available()

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


# ----------------------------------------------------------------------------------- helpers
def small_layout(hidden=64, width=16, dtype="float32", L=2, E=16) -> StoreLayout:
    return StoreLayout(L, E, hidden, width, dtype, fingerprint="test")


def write_random(path: Path, layout: StoreLayout, seed: int = 0) -> list:
    experts = [(gu.clone(), dn.clone()) for gu, dn in random_experts(layout, seed)]
    write_store(path, layout, iter(experts), progress=False)
    return experts


def timed_reads(
    monkeypatch, owner, attr: str = "read_into", delay_s: float = 0.0
) -> list[tuple[str, int, float, float]]:
    """Every call of `owner.<attr>` (a read whose first argument is its layer) from now on, as
    (thread name, layer, start, end), each made `delay_s` longer (a read as long as a big
    expert's)."""
    reads: list[tuple[str, int, float, float]] = []
    real = getattr(owner, attr)

    def read(*args):
        start = time.perf_counter()
        try:
            out = real(*args)
            if delay_s:
                time.sleep(delay_s)
            return out
        finally:
            name = threading.current_thread().name
            reads.append((name, int(args[0]), start, time.perf_counter()))

    monkeypatch.setattr(owner, attr, read)
    return reads


def reference(hidden, ids, weights, experts, layer, E):
    """Sum_r w_r * expert_{ids[r]}(x) from the full weights (a plain loop)."""
    out = torch.zeros_like(hidden)
    for n in range(hidden.shape[0]):
        for r in range(ids.shape[1]):
            gu, dn = experts[layer * E + int(ids[n, r])]
            g, u = (gu @ hidden[n]).chunk(2)
            out[n] += float(weights[n, r]) * (dn @ (ACT(g) * u))
    return out


# ----------------------------------------------------------------------------------- store
@pytest.mark.parametrize("hidden,width,mode", [(64, 16, "O_DIRECT"), (24, 6, "posix_fadvise")])
def test_store_roundtrip_and_cache_bypass(tmp_path, hidden, width, mode):
    lay = small_layout(hidden, width)
    experts = write_random(tmp_path / "x.bin", lay)
    with ExpertStore(tmp_path / "x.bin", expected=lay) as store:
        assert store.mode.startswith(mode)
        assert (tmp_path / "x.bin").stat().st_size == lay.file_bytes
        gu = aligned_empty(lay.gate_up_shape, torch.float32)
        dn = aligned_empty(lay.down_shape, torch.float32)
        for i in (0, 5, lay.num_experts + 3, 2 * lay.num_experts - 1):
            store.read_into(i // lay.num_experts, i % lay.num_experts, gu, dn)
            assert torch.equal(gu, experts[i][0]) and torch.equal(dn, experts[i][1])
        reads, seconds = store.read_clock()  # the disk's time per expert while a run reads
        assert reads == 4 and seconds > 0
        bw = measure_read_bandwidth(store, reads=8)
        assert bw.bytes_per_s > 0 and bw.latency_s > 0 and bw.reads == 8
    assert lay.direct_capable == (mode == "O_DIRECT")


def test_store_read_clock_counts_overlapping_reads_once(tmp_path, monkeypatch):
    """Two threads' reads in flight together: the disk was busy for the overlap once (a run
    whose host worker reads beside its background reads is not charged twice)."""
    lay = small_layout()
    write_random(tmp_path / "x.bin", lay)
    both_in = threading.Barrier(2)
    read = moesub.engine.store._preadv_full

    def slow_read(fd, bufs, offset):
        both_in.wait()
        time.sleep(0.05)
        read(fd, bufs, offset)

    monkeypatch.setattr(moesub.engine.store, "_preadv_full", slow_read)
    with ExpertStore(tmp_path / "x.bin", expected=lay) as store:
        bufs = [(aligned_empty(lay.gate_up_shape, torch.float32),
                 aligned_empty(lay.down_shape, torch.float32)) for _ in range(2)]  # fmt: skip
        threads = [threading.Thread(target=store.read_into, args=(0, e, *bufs[e]))
                   for e in range(2)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        reads, busy = store.read_clock()
    assert reads == 2 and 0.05 <= busy < 0.095


@pytest.mark.parametrize("alone_bytes", [0, 2**40])  # every expert read alone; in runs
@pytest.mark.parametrize("imaged", [(), (9, 15, 1)])  # experts held in RAM (1: not resident)
def test_tier_load_fills_the_slots_off_the_read_clock(tmp_path, monkeypatch, alone_bytes, imaged):
    """A load puts each resident expert in its slot: copied from the tier's image if it holds
    it, else read alone (large experts) or in runs of nearby ones (small), and zeroes the slots
    it leaves empty, in slot buffers of its own or an earlier tier's; the read clock, which
    times the decode's reads, is left alone."""
    monkeypatch.setattr(moesub.engine.tiers, "LOAD_ALONE_BYTES", alone_bytes)
    lay = small_layout()
    experts = write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin")
    image = SlotImage.read(store, [np.array([], np.int64), np.array(imaged, np.int64)])
    spied, read_into, read_raw = [], store.read_into, store.read_raw

    def spy_into(layer, e, *args, **kwargs):
        spied.append(e)
        return read_into(layer, e, *args, **kwargs)

    def spy_raw(offset, nbytes, buf):
        spied.append(offset)
        return read_raw(offset, nbytes, buf)

    monkeypatch.setattr(store, "read_into", spy_into)
    monkeypatch.setattr(store, "read_raw", spy_raw)
    earlier = DiskTier(store, 6, 4, ACT)  # a closed tier's slots, all ones: the next is made in
    earlier.close()  # them and its load leaves nothing of them (its empty slot zero)
    for s in earlier.slots:
        s.gate_up.fill_(1.0), s.down.fill_(1.0)
    with pytest.raises(ValueError, match="slots hold"):
        DiskTier(store, 5, 4, ACT, slots=earlier.slots)
    tier = DiskTier(store, 6, 4, ACT, image=image if imaged else None, slots=earlier.slots)
    try:
        resident = np.array([9, 2, 3, -1, 15, 4], np.int32)
        tier.load(1, resident)
        for slot, e in enumerate(resident.tolist()):
            gu, dn = tier.slots[1].gate_up[slot], tier.slots[1].down[slot]
            if e < 0:
                assert not gu.any() and not dn.any()
            else:
                want = experts[lay.num_experts + e]
                assert torch.equal(gu, want[0]) and torch.equal(dn, want[1])
        assert store.read_clock() == (0, 0.0)
        if alone_bytes == 0:  # one read per expert not in the image
            assert sorted(spied) == sorted({9, 2, 3, 15, 4} - set(imaged))
        else:  # this small an expert: 2-15 (or 2-4) are close enough for one sequential read
            assert len(spied) == 1
    finally:
        tier.close()


def resident_share(t: torch.Tensor) -> float:
    """The share of a CPU tensor's pages the kernel has backed (mincore(2))."""
    libc, page = ctypes.CDLL(None, use_errno=True), os.sysconf("SC_PAGE_SIZE")
    start, end = t.data_ptr() // page * page, t.data_ptr() + t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * ((end - start + page - 1) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(v & 1 for v in vec) / len(vec)


def test_disk_tier_writes_the_pages_its_timed_reads_go_into(tmp_path):
    """A fresh allocation's pages are backed on their first write, which an uncached read into
    them paid inside a token's step (20-48 ms an expert on this VM): the host's scratch, the
    staging buffers and the slots a load leaves empty are written where the tier is set up."""
    lay = small_layout(hidden=2048, width=512, L=1, E=4)  # 12 MiB experts; the scratch 48 MiB
    write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin")
    fresh = mmap.mmap(-1, 2**24)  # the measure on pages never written: none backed
    assert resident_share(torch.frombuffer(fresh, dtype=torch.uint8)) == 0.0
    tier = DiskTier(store, 3, 4, ACT, staging_buffers=2)
    try:
        tier.load(0, np.array([2, -1, 0], np.int32))
        written = [tier._host_gu, tier._host_dn, tier.slots[0].gate_up[1], tier.slots[0].down[1]]
        written += [b for pair in tier.reader.buffers for b in pair]
        assert [resident_share(t) for t in written] == [1.0] * len(written)
    finally:
        tier.close()


def test_store_faults(tmp_path):
    lay = small_layout()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ExpertStore(tmp_path / "missing.bin")
    write_random(tmp_path / "x.bin", lay)
    with pytest.raises(ValueError, match="shape mismatch"):
        ExpertStore(tmp_path / "x.bin", expected=small_layout(E=32))
    with pytest.raises(ValueError, match="other weights"):
        ExpertStore(tmp_path / "x.bin", expected=StoreLayout(2, 16, 64, 16, "float32", "other"))
    data = (tmp_path / "x.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[: len(data) - 4096])
    with pytest.raises(ValueError, match="truncated"):
        ExpertStore(tmp_path / "t.bin")
    (tmp_path / "bad.bin").write_bytes(b"\0" * 8192)
    with pytest.raises(ValueError, match="not an expert store"):
        ExpertStore(tmp_path / "bad.bin")
    # a wrong expert shape while writing: error, and no partial file left behind
    bad = iter([(torch.zeros(32, 64), torch.zeros(64, 8))])
    with pytest.raises(ValueError, match="expert shape mismatch"):
        write_store(tmp_path / "w.bin", lay, bad, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.bin", "t.bin", "x.bin"]
    # the engine's derived store: a truncated one is reported and rewritten from the source
    with pytest.warns(UserWarning, match="truncated"):
        store = open_or_write_store(tmp_path / "t.bin", lay, random_experts(lay, 0), False)
    store.close()
    assert (tmp_path / "t.bin").stat().st_size == lay.file_bytes
    with pytest.raises(FileNotFoundError, match="no source"):
        open_or_write_store(tmp_path / "none.bin", lay, None)


# ----------------------------------------------------------------------------------- engine
def drive(engine, trace, experts, E, hidden_dim, seed=0):
    """Run the engine over `trace` (T, L, E); check every computed output against the full-
    weight reference of the core's computed ids; return the statuses (T, L, k)."""
    g = torch.Generator().manual_seed(seed)
    T, L, _ = trace.shape
    statuses = []
    for t in range(T):
        engine.begin_token()
        row = []
        for layer in range(L):
            x = torch.randn(1, hidden_dim, generator=g)
            s = engine.route(layer, trace[t, layer][None])
            slot, host_ids = engine.step_ids(s)
            w = torch.from_numpy(s.weights).float()
            dev = engine.tier.slots[layer].gate_up.device
            host = None if host_ids is None else HostInputs(host_ids, x, w)
            y = engine.compute(layer, x.to(dev), slot, w.to(dev), host)
            ref = reference(x, s.ids, s.weights, experts, layer, E)
            torch.testing.assert_close(y.cpu(), ref, rtol=1e-4, atol=1e-5)
            row.append(s.status[0])
        engine.end_token()
        statuses.append(row)
    return np.array(statuses)


@pytest.mark.parametrize("rule", ["fetch_all", "threshold", "host_compute"])
def test_disk_engine_matches_core_and_full_weights(tmp_path, rule):
    lay = small_layout()
    E, k, C, L = lay.num_experts, 4, 6, lay.num_layers
    experts = write_random(tmp_path / "x.bin", lay)
    trace = synthetic_logits(40, L, E, seed=3)
    pol = Policy(rule=rule, tau=0.3)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    engine = OffloadEngine(DiskTier(store, C, k, ACT), E, k, C, pol, None, ACT)
    try:
        status = drive(engine, trace, experts, E, lay.hidden)
    finally:
        engine.close()
    # no admission: the engine's decisions are exactly the whole-stream scan's
    assert np.array_equal(status, scan(trace, k, C, pol).status)
    assert (status == {"fetch_all": FETCH, "threshold": SUB, "host_compute": HOST}[rule]).any()


def test_background_admission_installs_real_copies(tmp_path):
    lay = small_layout()
    E, k, C, L = lay.num_experts, 4, 6, lay.num_layers
    experts = write_random(tmp_path / "x.bin", lay)
    trace = synthetic_logits(120, L, E, seed=5)
    pol = Policy(rule="first_choice", eviction="lfu", beta=0.5)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    engine = OffloadEngine(DiskTier(store, C, k, ACT, staging_buffers=2), E, k, C, pol, None, ACT)
    bytes_bg = 0
    try:
        g = torch.Generator().manual_seed(0)
        for t in range(trace.shape[0]):
            engine.begin_token()
            for layer in range(L):
                s = engine.route(layer, trace[t, layer][None])
                x = torch.randn(1, lay.hidden, generator=g)
                slot, _ = engine.step_ids(s)
                y = engine.compute(layer, x, slot, torch.from_numpy(s.weights))
                ref = reference(x, s.ids, s.weights, experts, layer, E)
                torch.testing.assert_close(y, ref.to(y.dtype), rtol=1e-4, atol=1e-5)
            bytes_bg += engine.end_token().bytes_bg
        admitted = sum(c.counters()["admissions"] for c in engine.caches)
    finally:
        engine.close()
    assert admitted > 0 and bytes_bg == admitted * lay.expert_bytes


def test_expert_compute_is_timed_on_loaded_slots_only(tmp_path, monkeypatch):
    """Unwritten slots are zero pages (faulted in, then read from cache): the microbenchmark
    times only slots that hold an expert, and says so when too few do."""
    lay = small_layout()
    write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin")
    tier = DiskTier(store, 6, 4, ACT)
    tier.slots[0].gate_up.zero_()  # as fresh pages are (this small a buffer may be reused)
    try:
        with pytest.raises(ValueError, match="0 of layer 0's 6 slots hold an expert.*k=4"):
            measure_expert_compute(tier, 4)
        tier.load(0, np.array([3, 5, 7, -1, -1, -1], np.int32))
        with pytest.raises(ValueError, match="3 of layer 0's 6 slots"):
            measure_expert_compute(tier, 4)
        tier.load(0, np.array([3, 5, 7, 9, -1, -1], np.int32))
        timed = []
        module = importlib.import_module("moesub.engine.microbench")
        real = module.expert_forward

        def spy(hidden, ids, *args, **kwargs):
            timed.append(np.asarray(ids).copy())
            return real(hidden, ids, *args, **kwargs)

        monkeypatch.setattr(module, "expert_forward", spy)
        assert measure_expert_compute(tier, 4, reps=3) > 0
        assert len(timed) == 3 + 2 and all(sorted(ids.ravel()) == [0, 1, 2, 3] for ids in timed)
    finally:
        tier.close()


def test_install_is_timed_after_its_copy_has_landed(tmp_path, monkeypatch):
    """The install microbenchmark requests a copy, waits until it has landed, then times the
    tier's own install of it into a slot that holds an expert: never the read, every installed
    slot holds its expert's weights after, and every staging buffer is free again."""
    lay = small_layout()
    write_random(tmp_path / "x.bin", lay)
    tier = DiskTier(ExpertStore(tmp_path / "x.bin"), 6, 4, ACT)
    installs = []  # (start, end, expert, slot)
    real_install = tier.install

    def spy_install(layer, handle, slot):
        t0 = time.perf_counter()
        out = real_install(layer, handle, slot)
        installs.append((t0, time.perf_counter(), handle[0], slot))
        return out

    try:
        tier.slots[0].gate_up.zero_()  # as fresh pages are (this small a buffer may be reused)
        tier.load(0, np.array([0, 2, 4, -1, -1, -1], np.int32))
        reads = timed_reads(monkeypatch, tier.store, delay_s=0.005)
        monkeypatch.setattr(tier, "install", spy_install)
        assert measure_install(tier, reps=5) > 0.0
        assert len(reads) == len(installs) == 5
        for (*_, r1), (i0, _i1, _e, slot) in zip(reads, installs, strict=True):
            assert r1 <= i0 and slot in (0, 1, 2)  # after its read; a loaded slot
        spans = [(r0, r1) for *_, r0, r1 in reads]
        assert not any(r0 < i1 and i0 < r1 for r0, r1 in spans for i0, i1, _e, _s in installs)
        last = {slot: expert for _t0, _t1, expert, slot in installs}
        for slot, expert in last.items():
            gate_up, down = tier.read_range(0, expert, 1)
            torch.testing.assert_close(tier.slots[0].gate_up[slot], gate_up[0], rtol=0, atol=0)
            torch.testing.assert_close(tier.slots[0].down[slot], down[0], rtol=0, atol=0)
        assert tier.reader._requests.unfinished_tasks == 0
        assert tier.reader._free.qsize() == len(tier.reader.buffers)
    finally:
        tier.close()


def test_host_read_drag_times_the_slots_beside_the_hosts_reads(tmp_path, monkeypatch):
    """The drag microbenchmark times the loaded slots alone and while a thread reads experts as
    the host does (fresh from disk), stops its reader and raises its error; a tier that is not
    the disk tier's is not measured (0)."""
    lay = small_layout()
    write_random(tmp_path / "x.bin", lay)
    tier = DiskTier(ExpertStore(tmp_path / "x.bin"), 6, 4, ACT)
    module = importlib.import_module("moesub.engine.microbench")
    timed = []  # (start, end) of every timing
    real_time = module.mean_step_s

    def spy_time(step, sync, min_s):
        t0 = time.perf_counter()
        out = real_time(step, sync, min_s)
        timed.append((t0, time.perf_counter()))
        return out

    def fail(layer, host_ids):
        raise OSError("the disk went away")

    try:
        tier.load(0, np.array([0, 2, 4, 6, 8, 10], np.int32))
        threads = threading.active_count()
        monkeypatch.setattr(module, "mean_step_s", spy_time)
        # reads as long as a big expert's: the timing falls inside them
        reads = timed_reads(monkeypatch, tier, "host_read", delay_s=0.02)
        drag = measure_host_read_drag(tier, 4, rounds=3, min_s=0.005)
        assert math.isfinite(drag) and drag >= 0.0
        overlaps = [any(r0 < t1 and t0 < r1 for *_, r0, r1 in reads) for t0, t1 in timed]
        assert overlaps == [False, True] * 3  # alone, beside the reads, three times
        assert threading.active_count() == threads  # the reader stopped
        monkeypatch.setattr(tier, "host_read", fail)  # a failing reader's error comes back
        with pytest.raises(OSError, match="the disk went away"):
            measure_host_read_drag(tier, 4, rounds=1, min_s=0.0)
        assert measure_host_read_drag(SimpleNamespace(host_reads_link=True), 4) == 0.0
    finally:
        tier.close()


def test_background_read_drag_times_the_slots_beside_the_io_threads_reads(tmp_path, monkeypatch):
    """The background drag microbenchmark times the loaded slots alone and while the I/O thread
    reads one expert after another, fed between steps as the engine feeds it; it leaves nothing
    in flight and every staging buffer free; a tier that is not the disk tier's gives 0."""
    lay = small_layout()
    write_random(tmp_path / "x.bin", lay)
    tier = DiskTier(ExpertStore(tmp_path / "x.bin"), 6, 4, ACT)
    module = importlib.import_module("moesub.engine.microbench")
    timed = []  # (start, end) of every timing
    real_time = module.mean_step_s

    def spy_time(step, sync, min_s):
        t0 = time.perf_counter()
        out = real_time(step, sync, min_s)
        timed.append((t0, time.perf_counter()))
        return out

    try:
        tier.load(0, np.array([0, 2, 4, 6, 8, 10], np.int32))
        monkeypatch.setattr(module, "mean_step_s", spy_time)
        reads = timed_reads(monkeypatch, tier.store, delay_s=0.005)
        drag = measure_background_read_drag(tier, 4, rounds=3, min_s=0.02)
        assert math.isfinite(drag) and drag >= 0.0
        overlaps = [any(r0 < t1 and t0 < r1 for *_, r0, r1 in reads) for t0, t1 in timed]
        assert overlaps == [False, True] * 3  # alone, beside the reads, three times
        assert tier.reader._requests.unfinished_tasks == 0
        assert tier.reader._free.qsize() == len(tier.reader.buffers)
        assert measure_background_read_drag(SimpleNamespace(host_reads_link=True), 4) == 0.0
    finally:
        tier.close()


def test_engine_rejects_batched_steps(tmp_path):
    lay = small_layout()
    write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin")
    engine = OffloadEngine(DiskTier(store, 6, 4, ACT), 16, 4, 6, Policy(), None, ACT)
    try:
        with pytest.raises(ValueError, match="one token per step"):
            engine.route(0, synthetic_logits(2, 1, 16)[:, 0])
    finally:
        engine.close()


def test_cuda_requested_but_absent():
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="CUDA was requested"):
        require_cuda("cuda")
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda"):
        require_cuda("tpu")


# ----------------------------------------------------------------------------------- model
VOCAB, E_M, K_M, L_M, FRACTION = 97, 16, 4, 2, 0.375  # C = 6


def tiny_model(seed: int = 0):
    return tiny_qwen3_next(
        vocab=VOCAB, layers=L_M, experts=E_M, k=K_M, hidden=64, expert_width=16,
        layer_types=["linear_attention", "full_attention"], expert_std=0.3, seed=seed,
    )  # fmt: skip


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_stage")
    tiny_model().save_pretrained(root / "model")
    write_parquet(random_streams([16, 12], VOCAB, seed=7), root / "streams.parquet")
    run_capture(
        root / "model", root / "streams.parquet", root / "tokens.parquet", root / "router.parquet"
    )
    run_expert_ranking(root / "router.parquet", root / "initial.parquet")
    return root


def engine_run(stage, name, policy, tmp_path, device="cpu", **params):
    out = tmp_path / f"{name}.parquet"
    opts = {"store_path": str(stage / "engine" / "experts.bin"), "progress": False, **params}
    run_engine(
        stage / "model", stage / "tokens.parquet", stage / "initial.parquet", name, policy,
        FRACTION, device, out, opts,
    )  # fmt: skip
    return pl.read_parquet(out), read_metadata(out)


def test_fetch_every_miss_nll_equals_capture(stage, tmp_path):
    captured = pl.read_parquet(stage / "tokens.parquet")["nll"].to_numpy()
    df, meta = engine_run(stage, "fetch_every_miss", {"rule": "fetch_all"}, tmp_path)
    assert list(df.columns[:12]) == list(ROW_COLUMNS[:12]) and set(ROW_COLUMNS) <= set(df.columns)
    assert meta["tier_kind"] == "disk->RAM" and "fresh uncached disk read" in meta["tier"]
    assert meta["capacity"] == 6 and meta["read_bandwidth_Bps"] > 0
    nll = df["nll"].to_numpy()
    assert np.isnan(nll[df["pos"].to_numpy() == 0]).all()
    ok = ~np.isnan(captured)
    # KV-cache decoding vs one full forward: equal up to float rounding (measured <= 1e-6)
    np.testing.assert_allclose(nll[ok], captured[ok], rtol=0, atol=5e-6)
    assert df["fetch"].sum() > 0 and df["sub"].sum() == 0  # misses really fetched
    assert (df["bytes_sync"] == df["fetch"] * meta["expert_bytes"]).all()
    assert (df["hit"] + df["fetch"] == L_M * K_M).all()
    # host waits per token: the router's values once per layer, and the token's end
    assert (df["syncs"] == L_M + 1).all() and meta["syncs_per_token_mean"] == L_M + 1
    # per-token-layer counts: per stream (T, L, F), summing over layers to the status columns
    counts = np.concatenate(stream_counts(df))
    assert counts.shape == (df.height, L_M, len(TOKEN_LAYER_FIELDS))
    for i, status in enumerate(STATUS_NAMES):
        np.testing.assert_array_equal(counts[:, :, i].sum(1), df.sort("stream", "pos")[status])
    assert 0 < meta["cpu_share"] <= 1 and isinstance(meta["contended"], bool)
    # all_resident and host_compute compute the same exact model
    full, fmeta = engine_run(stage, ALL_RESIDENT, {}, tmp_path)
    assert fmeta["capacity"] == E_M and (full["hit"] == L_M * K_M).all()
    np.testing.assert_allclose(full["nll"].to_numpy()[ok], captured[ok], rtol=0, atol=5e-6)
    host, _ = engine_run(stage, "host_compute", {"rule": "host_compute"}, tmp_path)
    assert host["host"].sum() > 0 and host["fetch"].sum() == 0
    np.testing.assert_allclose(host["nll"].to_numpy()[ok], captured[ok], rtol=0, atol=5e-6)
    summ = summarize_engine(
        {
            "fetch_every_miss": tmp_path / "fetch_every_miss.parquet",
            "host_compute": tmp_path / "host_compute.parquet",
        }
    )
    assert (
        summ.filter(pl.col("policy") == "fetch_every_miss")["speedup_vs_fetch_every_miss"][0] == 1
    )


@pytest.mark.parametrize("admission", ["delay", "completion"])
def test_prefetch_keeps_fetch_every_miss_exact(stage, tmp_path, admission):
    """fetch_all with prefetch 2 through the model path (lookahead one MoE layer early): still
    the captured NLL (prefetch changes what is resident, never what is computed); the per-token
    overlap columns and the summary's prefetch figures are filled."""
    captured = pl.read_parquet(stage / "tokens.parquet")["nll"].to_numpy()
    spec = {"rule": "fetch_all", "prefetch": 2}
    df, meta = engine_run(stage, "fetch_prefetch", spec, tmp_path, admission=admission)
    ok = ~np.isnan(captured)
    np.testing.assert_allclose(df["nll"].to_numpy()[ok], captured[ok], rtol=0, atol=5e-6)
    issued = int(df["prefetches"].sum())
    assert issued > 0 and 0 <= df["prefetch_in_time"].sum() <= issued
    assert df["bytes_prefetch"].sum() % meta["expert_bytes"] == 0
    assert 0 <= meta["prefetch_timeliness"] <= 1
    summ = summarize_engine({"fetch_prefetch": tmp_path / "fetch_prefetch.parquet"})
    assert summ["prefetch_timeliness"][0] == meta["prefetch_timeliness"]
    assert summ["bytes_prefetch"][0] == df["bytes_prefetch"].mean()


def test_substituting_policy_changes_nll(stage, tmp_path):
    captured = pl.read_parquet(stage / "tokens.parquet")["nll"].to_numpy()
    spec = {"rule": "first_choice", "eviction": "lfu", "beta": 0.5}
    # admission="delay" installs each copy at its due token (waiting for it if needed); with
    # "completion" a short run can end before any copy lands
    df, meta = engine_run(stage, "speed", spec, tmp_path, admission="delay")
    assert meta["policy"] == spec
    assert df["sub"].sum() > 0
    # admissions were copied by the background I/O thread and installed through the model path
    assert df["bytes_bg"].sum() > 0 and df["bytes_bg"].sum() % meta["expert_bytes"] == 0
    assert meta["admit_latency_tokens_mean"] == 1.0  # the policy's delay, exactly
    ok = ~np.isnan(df["nll"].to_numpy())
    assert np.abs(df["nll"].to_numpy()[ok] - captured[: df.height][ok]).max() > 1e-3


def test_planned_layout_holds_per_layer_slots(stage, tmp_path):
    """A planned layout (per-layer slot counts, sum L x C) runs on the engine: each layer's
    cache holds its own C_l, so the per-token-layer counts equal the core's scan of the
    captured logits at that layout (not at uniform C), and fetch_all stays exact."""
    C = capacity_for(FRACTION, E_M)
    caps = [C - 2, C + 2]
    (tmp_path / "alloc.json").write_text(json.dumps({"capacity": C, "capacities": caps}))
    spec = {"rule": "fetch_all", "allocation": "planned"}
    out = tmp_path / "planned.parquet"
    opts = {"store_path": str(stage / "engine" / "experts.bin"), "progress": False}
    run_engine(
        stage / "model", stage / "tokens.parquet", stage / "initial.parquet", "planned", spec,
        FRACTION, "cpu", out, opts, allocation_path=tmp_path / "alloc.json",
    )  # fmt: skip
    df, meta = pl.read_parquet(out), read_metadata(out)
    assert meta["layout"]["capacities"] == caps and meta["layout"]["allocation"] == "planned"
    captured = pl.read_parquet(stage / "tokens.parquet")["nll"].to_numpy()
    ok = ~np.isnan(captured)
    np.testing.assert_allclose(df["nll"].to_numpy()[ok], captured[ok], rtol=0, atol=5e-6)
    layout = layout_for(stage / "initial.parquet", FRACTION, spec, K_M, L_M, E_M,
                        tmp_path / "alloc.json")  # fmt: skip
    trace = load_trace(stage / "router.parquet")
    for s, logits in zip(trace.streams, trace.logits, strict=True):
        rows = df.filter(pl.col("stream") == s).sort("pos")
        got = np.array(rows["token_layer_counts"].to_list()).reshape(rows.height, L_M, -1)
        pol = layout.policy(spec)
        want = token_layer_counts(scan(logits, K_M, caps, pol, initial=list(layout.initial)))
        assert np.array_equal(got, want), s
        uniform = token_layer_counts(scan(logits, K_M, C, pol, initial=None))
        assert not np.array_equal(got, uniform)


def test_run_engine_faults_and_atomic_output(stage, tmp_path, monkeypatch):
    fem = {"rule": "fetch_all"}
    with pytest.raises(ValueError, match=r"C_l=\d+, outside \[k="):
        run_engine(
            stage / "model", stage / "tokens.parquet", stage / "initial.parquet", "x", fem, 0.1,
            "cpu", tmp_path / "o.parquet",
        )  # fmt: skip
    with pytest.raises(FileNotFoundError, match="tokens_path"):
        run_engine(stage / "model", tmp_path / "no.parquet", stage / "initial.parquet", "x", fem,
                   FRACTION, "cpu", tmp_path / "o.parquet")  # fmt: skip
    # a planned layout whose slots do not sum to L x C is refused before any work
    C = capacity_for(FRACTION, E_M)
    (tmp_path / "alloc.json").write_text(json.dumps({"capacity": C, "capacities": [C, C + 1]}))
    with pytest.raises(ValueError, match="sum"):
        run_engine(
            stage / "model", stage / "tokens.parquet", stage / "initial.parquet", "x",
            {**fem, "allocation": "planned"}, FRACTION, "cpu", tmp_path / "o.parquet",
            allocation_path=tmp_path / "alloc.json",
        )  # fmt: skip
    assert not (tmp_path / "o.parquet").exists()
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA was requested"):
            engine_run(stage, "x", fem, tmp_path, device="cuda")
    with pytest.raises(ValueError, match="unknown engine option"):
        engine_run(stage, "x", fem, tmp_path, bogus=1)
    # a store written from other weights of the same shape is rejected, not silently used
    bad = tmp_path / "other.bin"
    lay = StoreLayout(L_M, E_M, 64, 16, "float32", fingerprint="someone-else")
    write_store(bad, lay, random_experts(lay, 0), progress=False)
    from moesub.engine.store import ExpertStore as _Store

    with pytest.raises(ValueError, match="other weights"):
        _Store(bad, expected=StoreLayout(L_M, E_M, 64, 16, "float32", fingerprint="mine"))

    # an interrupted run leaves no output and no temp file
    calls = {"n": 0}
    real = EngineModel.decode

    def interrupted(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(EngineModel, "decode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine_run(stage, "fetch_every_miss", fem, tmp_path)
    assert not any(p.name.startswith((".fetch_every_miss", "fetch_every_miss"))
                   for p in tmp_path.iterdir())  # fmt: skip


def test_cpu_meter_sums_its_intervals_only(monkeypatch):
    """A meter paused between runs counts only its intervals, and `stop` after a `pause` adds
    nothing (fake clocks: wall, CPU and schedstat's on-CPU / waiting seconds)."""
    import moesub.engine.contention as contention

    now = {"wall": 0.0, "cpu": 0.0, "on": 0.0, "wait": 0.0, "busy": 0.0, "steal": 0.0}
    monkeypatch.setattr(contention.time, "perf_counter", lambda: now["wall"])
    monkeypatch.setattr(contention.time, "process_time", lambda: now["cpu"])
    monkeypatch.setattr(contention, "_schedstat", lambda: (now["on"], now["wait"]))
    monkeypatch.setattr(contention, "_machine_busy", lambda: (now["busy"], now["steal"]))

    def advance(wall, cpu, on, wait, others=0.0, steal=0.0):
        """`wall` seconds in which the process ran `cpu` (`on` CPU, `wait`ing for one) and the
        machine's other processes `others`, its host stealing `steal`."""
        deltas = (wall, cpu, on, wait, cpu + others, steal)
        for key, dt in zip(("wall", "cpu", "on", "wait", "busy", "steal"), deltas, strict=True):
            now[key] += dt

    meter = contention.CpuMeter().start()
    advance(2.0, 2.0, 1.8, 0.2, others=0.05)
    meter.pause()
    advance(10.0, 1.0, 1.0, 9.0, others=9.0)  # another run's stretch, busy: not this meter's
    meter.start()
    advance(1.0, 1.0, 0.9, 0.1, others=0.1, steal=0.06)
    meter.pause()
    advance(5.0, 0.0, 0.0, 5.0, others=5.0)  # between the last run and the write
    out = meter.stop()
    assert out["cpu_share"] == pytest.approx(2.7 / 3.0)
    assert out["other_cores"] == pytest.approx(0.21 / 3.0)  # steal included
    assert out["steal_cores"] == pytest.approx(0.06 / 3.0)
    assert out["cpu_time_per_wall"] == pytest.approx(1.0) and not out["contended"]

    # a share near 1 beside another job that kept a fifth of a core busy: contended all the same
    meter = contention.CpuMeter().start()
    advance(4.0, 4.0, 3.8, 0.2, others=0.7, steal=0.1)
    out = meter.stop()
    assert out["cpu_share"] == pytest.approx(0.95) and out["other_cores"] == pytest.approx(0.2)
    assert out["contended"]
    # without the machine's counters (not Linux) the others are unknown and the share decides
    monkeypatch.setattr(contention, "_machine_busy", lambda: None)
    meter = contention.CpuMeter().start()
    advance(4.0, 4.0, 3.8, 0.2, others=1.8)
    out = meter.stop()
    assert math.isnan(out["other_cores"]) and not out["contended"]


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc/stat")
def test_cpu_meter_sees_another_process_beside_a_quiet_run():
    """A process spinning beside a run that sleeps: the run's share stays near 1 (it asked for
    no CPU), the machine's counters show the other process's core, and the run is contended."""
    import subprocess
    import sys

    from moesub.engine.contention import CpuMeter

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter started and spinning
        meter = CpuMeter().start()
        time.sleep(1.0)
        out = meter.stop()
    finally:
        spin.kill()
        spin.wait()
    assert out["other_cores"] > 0.5, out
    assert out["contended"]


def test_calibrate_fits_this_machines_profile(stage, tmp_path, monkeypatch):
    out = tmp_path / "calibration.json"
    references = []  # the clocks the disk's reference speed is taken from

    def spy_reference(clocks):
        references.append(list(clocks))
        return reference_clock(clocks)

    module = importlib.import_module("moesub.engine.calibrate")  # (the package's is a function)
    monkeypatch.setattr(module, "reference_clock", spy_reference)
    opts = {"store_path": str(stage / "engine" / "experts.bin"), "progress": False,
            "calibrate_tokens": 12, "calibrate_streams": 2, "calibrate_rounds": 1}  # fmt: skip
    cal = calibrate(
        stage / "model", "cpu", stage / "tokens.parquet", stage / "initial.parquet", FRACTION,
        out, opts,
    )  # fmt: skip
    assert json.loads(out.read_text()) == cal
    assert cal["runs"] == dict.fromkeys(("cal_hits", "cal_fetch", "cal_host", "cal_admit"), 24)
    assert cal["expert_bytes"] == 3 * 64 * 16 * 4 and cal["fit"]["tokens"] == 4 * 24
    assert all(v >= 0 for v in cal["unit_costs"].values())
    assert 0 < cal["cpu_share"] <= 1 and isinstance(cal["contended"], bool)
    # the microbenchmarks after each run of a C-slot tier (three mechanisms, one round), their
    # medians in the profile
    micro = cal["microbenchmarks"]
    assert len(micro["runs"]) == 3 and micro["median"]["expert_compute_s"] > 0
    for key, value in micro["median"].items():
        assert value == pytest.approx(np.median([run[key] for run in micro["runs"]])), key
    for key in ("host_read_drag", "background_read_drag"):
        assert cal["unit_costs"][key] == micro["median"][key]
    assert cal["expert_compute_s"] == micro["median"]["expert_compute_s"]
    profile = this_machine(out)  # the profile the price stage reads
    # one processor; the disk tier's host computes from fresh disk reads, over the copies' link
    assert (profile.source, profile.concurrent_host, profile.host_reads_link) == (
        "measured", False, True,
    )  # fmt: skip
    u = profile.price(ModelBytes(cal["expert_bytes"]))
    assert u.host_reads_link
    for key, seconds in cal["unit_costs"].items():
        assert getattr(u, key) == pytest.approx(seconds, rel=1e-9), key
    with pytest.raises(ValueError, match="calibrate_rounds=0"):
        calibrate(stage / "model", "cpu", stage / "tokens.parquet", stage / "initial.parquet",
                  FRACTION, out, {**opts, "calibrate_rounds": 0})  # fmt: skip
    # the calibration's reference run on the disk (the median reader) and its copy term at
    # that run's speed: the price stage prices each engine run at the disk's speed while it read
    disk = cal["at_run_disk"]
    assert disk["reads"] > 0 and disk["busy_s"] > 0
    # ... of the copy runs alone (two streams, one round): the host's and the admissions' reads
    # go at speeds of their own
    (copy_runs, *_) = references
    assert len(copy_runs) == 2 and AtRunDisk.from_dict(disk).reference in copy_runs
    assert asdict(DiskClock.pooled(copy_runs)) == cal["disk_by_mechanism"]["cal_fetch"]
    # each mechanism's runs priced at the profile against their time
    assert set(cal["run_errors"]) == set(cal["runs"])
    assert all(math.isfinite(e) and e > -1 for e in cal["run_errors"].values())
    beyond_read = cal["fit"]["copy_s"]
    assert cal["unit_costs"]["copy_s"] == pytest.approx(
        beyond_read + disk["busy_s"] / disk["reads"], rel=1e-12
    )
    _df, meta = engine_run(stage, "fetch_every_miss", {"rule": "fetch_all"}, tmp_path)
    assert meta["disk_reads"] > 0 and meta["disk_busy_s"] > 0
    profile_path = tmp_path / "this_machine.json"
    write_profile(THIS_MACHINE, None, out, {}, profile_path)
    priced = run_price(profile_path, [], [tmp_path / "fetch_every_miss.parquet"],
                       tmp_path / "priced.parquet")  # fmt: skip
    row = priced.row(0, named=True)
    assert row["source"] == "engine" and row["time_per_token_at_run_disk_s"] > 0
    # the calibration runs' errors travel with the profile to the priced table
    assert json.loads(profile_path.read_text())["run_errors"] == cal["run_errors"]
    assert read_metadata(tmp_path / "priced.parquet")["calibration_run_errors"] == cal["run_errors"]
    costs = UnitCosts(**json.loads(profile_path.read_text())["unit_costs"])
    ref_speed = {"disk_reads": disk["reads"], "disk_busy_s": disk["busy_s"]}
    at_ref = costs_at_run_disk(costs, disk, ref_speed)
    assert at_ref.copy_s == pytest.approx(costs.copy_s, rel=1e-12)
    assert at_ref.host_expert_s == costs.host_expert_s  # the profile's own: no second fit
    slower = costs_at_run_disk(costs, disk, {**ref_speed, "disk_busy_s": 2 * disk["busy_s"]})
    assert slower.copy_s == pytest.approx(costs.copy_s + disk["busy_s"] / disk["reads"])
    # no disk record (the CUDA tier; an older artefact): nothing to price it at
    assert costs_at_run_disk(costs, None, ref_speed) is None
    # and at the machine's speed while it ran, probed on its own tokens that only hit (its
    # copies at its disk's speed): the price at those costs, exactly. fetch_every_miss fetches
    # at nearly every token of this tiny model: too few to probe, its disk's price kept
    assert math.isnan(row["run_speed"])
    assert row["time_per_token_at_run_speed_s"] == row["time_per_token_at_run_disk_s"]
    _df, meta = engine_run(stage, "substitute_all", {"rule": "substitute_all"}, tmp_path)
    (row,) = run_price(profile_path, [], [tmp_path / "substitute_all.parquet"],
                       tmp_path / "priced.parquet").rows(named=True)  # fmt: skip
    df = pl.read_parquet(tmp_path / "substitute_all.parquet")
    streams, at_disk = stream_counts(df), costs_at_run_disk(costs, disk, meta)
    wall = df.sort("stream", "pos")["wall_s"].to_numpy()
    speed = speed_probe(wall, np.concatenate(streams), price_streams(streams, 1, at_disk).token_s)
    assert row["run_speed"] == pytest.approx(speed, rel=1e-12) and speed > 0
    at_speed = price_streams(streams, 1, costs_at_speed(at_disk, speed)).time_per_token_s
    assert row["time_per_token_at_run_speed_s"] == pytest.approx(at_speed, rel=1e-12)
    # each stream's time and price (as measured) in all, for the error's interval over them
    by_stream = df.group_by("stream").agg(pl.col("wall_s").sum()).sort("stream")["wall_s"]
    assert row["stream_time_s"] == pytest.approx(by_stream.to_list(), rel=1e-12)
    assert row["stream_priced_s"] == pytest.approx(
        [price_streams([c], 1, costs).token_s.sum() for c in streams], rel=1e-12
    )
    assert sum(row["stream_priced_s"]) / sum(row["stream_time_s"]) == pytest.approx(
        row["time_per_token_s"] / row["measured_time_per_token_s"], rel=1e-12
    )
    assert costs_at_run_disk(costs, disk, {}) is None
    # the calibration refitted with each round left out (none from one round) travels with the
    # profile, priced alike; a run decoded in the engine stage's rounds is priced at each refit
    # (its jackknife: `moesub.run_speed.engine_jackknife`), a run decoded alone at none
    assert json.loads(profile_path.read_text())["jackknife_unit_costs"] == []
    assert row["jackknife_rel_error"] == [] and row["calibration_jackknife_rel_error"] == []
    dear = replace(this_machine(out), token_overhead_s=this_machine(out).token_overhead_s + 1e-3)
    refit_cal = {**cal, "jackknife_profiles": [cal["profile"], dear.to_dict(), cal["profile"]]}
    (tmp_path / "refit_cal.json").write_text(json.dumps(refit_cal))
    write_profile(THIS_MACHINE, None, tmp_path / "refit_cal.json", {}, tmp_path / "jk.json")
    refits = [UnitCosts(**u) for u in json.loads((tmp_path / "jk.json").read_text())[
        "jackknife_unit_costs"]]  # fmt: skip
    assert refits[0] == refits[2] == costs and refits[1].token_overhead_s > costs.token_overhead_s
    write_parquet(df, tmp_path / "rounds.parquet", metadata={**meta, "stream_rounds": [0, 2]})
    (row,) = run_price(tmp_path / "jk.json", [], [tmp_path / "rounds.parquet"],
                       tmp_path / "priced.parquet").rows(named=True)  # fmt: skip
    joint, alone = engine_jackknife(wall, streams, 1, refits, [0, 2])
    assert row["jackknife_rel_error"] == pytest.approx(joint, rel=1e-12)
    assert row["calibration_jackknife_rel_error"] == pytest.approx(alone, rel=1e-12)
    assert len(joint) == 3 and alone[1] > alone[0]
    # a run with no disk record (the CUDA tier's, an older artefact's) is priced once at the
    # profile's costs, and that price is what its speed is probed against: two pricings, not
    # three
    no_disk = {k: v for k, v in meta.items() if k not in ("disk_reads", "disk_busy_s")}
    write_parquet(df, tmp_path / "no_disk.parquet", metadata=no_disk)
    calls: list[UnitCosts] = []

    def counted(streams, delay, u):
        calls.append(u)
        return price_streams(streams, delay, u)

    monkeypatch.setattr(moesub.price, "price_streams", counted)
    monkeypatch.setattr(moesub.run_speed, "price_streams", counted)
    (row,) = run_price(profile_path, [], [tmp_path / "no_disk.parquet"],
                       tmp_path / "priced.parquet").rows(named=True)  # fmt: skip
    plain = price_streams(streams, 1, costs).token_s
    speed = speed_probe(wall, np.concatenate(streams), plain)
    assert calls == [costs, costs_at_speed(costs, speed)]
    assert row["run_speed"] == pytest.approx(speed, rel=1e-12)
    assert row["time_per_token_at_run_disk_s"] is None  # no disk to price it at
    assert row["time_per_token_s"] == pytest.approx(plain.mean(), rel=1e-12)


def test_engine_stage_interleaves_the_calibration_and_the_runs(stage, tmp_path, monkeypatch):
    """The pipeline's engine job: the calibration's runs spread among the policies' and rotated
    over the rounds, as in the engine bench, each policy decoding its share of the streams per
    round; its rows are a one-engine run's but for the times, and the calibration is whole.
    The model is loaded once, and every run's engine is built on it."""
    opts = {"store_path": str(stage / "engine" / "experts.bin"), "progress": False,
            "calibrate_tokens": 12, "calibrate_rounds": 2}  # fmt: skip
    policies = {"fetch_every_miss": {"rule": "fetch_all"},
                "rule_015": {"rule": "threshold", "tau": 0.15}}  # fmt: skip
    runs = {str(tmp_path / f"{n}.parquet"): (n, p, FRACTION, None) for n, p in policies.items()}
    calls: list[tuple[str, tuple[int, ...]]] = []
    cal_run, decode, load = Calibration.run, PolicyRun.decode, moesub.models.load_model
    models, shared = [], set()

    def record_cal(self, name, loaded=None):
        calls.append((name, ()))
        shared.add(id(loaded))
        cal_run(self, name, loaded)

    def record_decode(self, parts, progress=True, loaded=None, round_=None):
        calls.append((next(o for o, r in runs.items() if r[0] == self.name), tuple(parts)))
        shared.add(id(loaded))
        decode(self, parts, progress, loaded, round_)

    def record_load(*args, **kwargs):
        models.append(load(*args, **kwargs))
        return models[-1]

    monkeypatch.setattr(Calibration, "run", record_cal)
    monkeypatch.setattr(PolicyRun, "decode", record_decode)
    monkeypatch.setattr(moesub.models, "load_model", record_load)
    cal_path = tmp_path / "calibration.json"
    run_engine_stage(stage / "model", "cpu", stage / "tokens.parquet", stage / "tokens.parquet",
                     stage / "initial.parquet", runs, FRACTION, cal_path, opts)  # fmt: skip
    order = round_order(spread(list(MECHANISMS), list(runs)), 2)
    assert [key for key, _ in calls] == order
    per_round = len(order) // 2
    for step, (key, parts) in enumerate(calls):  # two streams: one per round, in order
        assert parts == (() if key in MECHANISMS else (step // per_round,)), (step, key)
    cal = json.loads(cal_path.read_text())
    assert cal["runs"] == dict.fromkeys(MECHANISMS, 2 * 12)  # two rounds of one stream each
    assert len(cal["microbenchmarks"]["runs"]) == 6
    assert cal["jackknife_profiles"] == []  # two rounds: too few to leave one out
    assert len(models) == 1 and len(shared) == 1 and id(None) not in shared
    monkeypatch.undo()
    timing = {"wall_s", "fetch_wait_s", "admit_wait_s", "prefetch_wait_s", "host_wait_s"}
    for out, (name, policy, _size, _alloc) in runs.items():
        staged, meta = pl.read_parquet(out), read_metadata(out)
        alone, alone_meta = engine_run(stage, name, policy, tmp_path / "alone", **opts)
        same = [c for c in alone.columns if c not in timing]
        assert staged.select(same).equals(alone.select(same)), name
        assert meta["summary"]["ppl"] == alone_meta["summary"]["ppl"]
        assert meta["disk_reads"] == alone_meta["disk_reads"] and 0 < meta["cpu_share"] <= 1
        # the round each stream was decoded in (the jackknife's), none outside the stage
        assert meta["stream_rounds"] == [0, 1] and alone_meta["stream_rounds"] is None
    # a run not decoded whole is never written
    run = PolicyRun(stage / "model", stage / "tokens.parquet", stage / "initial.parquet",
                    "fetch_every_miss", {"rule": "fetch_all"}, FRACTION, "cpu", opts)  # fmt: skip
    run.decode([1])
    with pytest.raises(ValueError, match=r"streams \[0\] were not decoded"):
        run.write(tmp_path / "half.parquet")
    assert not (tmp_path / "half.parquet").exists()


def test_calibration_runs_take_the_streams_in_turn_and_space_the_microbenchmarks(
    stage, monkeypatch
):
    """Each run of a mechanism decodes the next `calibrate_streams` calibration streams in turn
    (over many short rounds the runs cover them, not the first ones again), and the
    microbenchmarks follow `MICRO_RUNS` of each C-slot mechanism's runs, spread over the rounds:
    at 5 rounds its runs 0, 2 and 4."""
    opts = {"store_path": str(stage / "engine" / "experts.bin"), "progress": False,
            "calibrate_tokens": 12, "calibrate_rounds": 5}  # fmt: skip
    cal = Calibration(stage / "model", "cpu", stage / "tokens.parquet", stage / "initial.parquet",
                      FRACTION, opts)  # fmt: skip
    assert len(cal.streams) == 2 and cal.opts.calibrate_streams == 1  # the shipped default
    decoded, micro = [], []
    decode = EngineModel.decode

    def record_decode(self, inputs, *args, **kwargs):
        decoded.append((self.spec.name, list(inputs)))
        return decode(self, inputs, *args, **kwargs)

    def fake_micro(tier, k, drag_rounds):  # which run of which mechanism it follows
        name = decoded[-1][0]
        micro.append((name, sum(n == name for n, _ids in decoded) - 1))
        return {"expert_compute_s": 1e-4, "host_read_drag": 0.0, "background_read_drag": 0.0,
                "install_s": 1e-5}  # fmt: skip

    monkeypatch.setattr(EngineModel, "decode", record_decode)
    module = importlib.import_module("moesub.engine.calibrate")  # not the function
    monkeypatch.setattr(module, "microbenchmarks", fake_micro)
    for name in cal.order():
        cal.run(name)
    streams = [s.tolist() for s in cal.streams]
    for name in MECHANISMS:
        runs = [ids for n, ids in decoded if n == cal.specs[name].name]
        assert runs == [streams[i % 2] for i in range(5)], name
    assert MICRO_RUNS == 4 and cal.micro_every == 2
    # after runs 0, 2, 4 of the three C-slot mechanisms (cal_hits holds every expert)
    c_slot = [cal.specs[n].name for n, policy in MECHANISMS.items() if policy is not None]
    assert sorted(micro) == sorted((n, i) for n in c_slot for i in (0, 2, 4))
    assert len(cal.micro) == 3 * 3
    result = cal.result()
    assert result["runs"] == dict.fromkeys(MECHANISMS, 5 * 12)
    # refitted with each round left out: that round's runs of every mechanism and the
    # microbenchmarks taken in it dropped, as a calibration that never had them
    assert len(result["jackknife_profiles"]) == 5
    for r in (1, 2):
        without = copy.copy(cal)
        without.timed, without.disk, without.counted = (
            {name: runs[:r] + runs[r + 1 :] for name, runs in d.items()}
            for d in (cal.timed, cal.disk, cal.counted)
        )  # fmt: skip
        kept = [i for i, m in enumerate(cal.micro_rounds) if m != r]
        without.micro = [cal.micro[i] for i in kept]
        without.micro_rounds = [cal.micro_rounds[i] for i in kept]
        assert len(without.micro) == (6 if r == 2 else 9)
        assert result["jackknife_profiles"][r] == without._fit()[-1].to_dict()
        assert result["jackknife_profiles"][r] != result["profile"]
    two = Calibration(stage / "model", "cpu", stage / "tokens.parquet", stage / "initial.parquet",
                      FRACTION, {**opts, "calibrate_streams": 3})  # fmt: skip
    assert [s.tolist() for s in two.run_streams(1)] == streams  # at most every stream once


# ----------------------------------------------------------------------------------- bench
def recording_tiers(monkeypatch) -> list:
    """The bench's disk tiers, each recording the layers it loaded (from the initial set's
    image), whether it was closed, the torch threads and the tiers still open when it was made;
    named as the tier that ran (the rows name it, as CUDA's)."""
    tiers = []

    class Tier(DiskTier):
        def __init__(self, *args, **kwargs):
            self.open_beside = [t for t in tiers if not t.closed]
            self.threads = torch.get_num_threads()
            super().__init__(*args, **kwargs)
            self.closed, self.loads = False, []
            self.kind = "disk->RAM (this instance)"
            tiers.append(self)

        def load(self, layer, resident):
            assert self.image is not None
            self.loads.append(layer)
            super().load(layer, resident)

        def close(self):
            super().close()
            self.closed = True

    monkeypatch.setattr("moesub.engine.bench.DiskTier", Tier)
    return tiers


def test_benchmark_table(tmp_path, monkeypatch):
    params = dict(
        layers=2, num_experts=32, hidden=64, width=16, top_k=4, dtype="float32", tokens=30,
        warmup=4, calib_tokens=300, store_path=str(tmp_path / "b.bin"), progress=False,
        routing="synthetic", rounds=1, threads=1,
    )  # fmt: skip
    caller_threads = torch.get_num_threads()
    tiers = recording_tiers(monkeypatch)
    df = run_benchmark(params, "cpu", tmp_path / "bench.parquet")
    # 6 policies + 5 calibration runs (hits, fetch, host, admit, hits over one layer), each on
    # a tier of its own, closed before the next one is made, but all_resident's (E = 32 slots
    # per layer), kept across its rounds
    assert len(tiers) == 11 and all(t.closed for t in tiers)
    assert all(o.slots[0].capacity == 32 for t in tiers for o in t.open_beside)
    # the runs computed with the configured threads, and the caller's are given back
    assert {t.threads for t in tiers} == {1} and torch.get_num_threads() == caller_threads
    assert set(df["tier"]) == {"disk->RAM (this instance)"}
    assert all(t.loads == [0, 1] for t in tiers)  # each run's slots loaded once
    assert set(df["policy"]) == {
        "fetch_every_miss", "host_compute", "rule_015", "quality", "speed", ALL_RESIDENT,
    }  # fmt: skip
    by = {r["policy"]: r for r in df.iter_rows(named=True)}
    assert by["fetch_every_miss"]["speedup_vs_fetch_every_miss"] == 1.0
    assert by["host_compute"]["speedup_vs_host_compute"] == 1.0
    assert by[ALL_RESIDENT]["hit_rate"] == 1.0 and by[ALL_RESIDENT]["bytes_sync"] == 0
    assert by["fetch_every_miss"]["sub_rate"] == 0 and by["fetch_every_miss"]["bytes_sync"] > 0
    # one round: no jackknife over the rounds
    assert by["fetch_every_miss"]["jackknife_rel_error"] == []
    assert by["speed"]["sub_rate"] > 0
    r = by["speed"]
    assert r["speedup_vs_fetch_every_miss"] == pytest.approx(
        by["fetch_every_miss"]["time_per_token_median_s"] / r["time_per_token_median_s"]
    )
    meta = read_metadata(tmp_path / "bench.parquet")
    assert meta["store_mode"] == "O_DIRECT" and meta["disk_read_bandwidth_Bps"] > 0
    assert meta["threads"] == 1
    profile = HardwareProfile.from_dict("this_machine", meta["profile"])
    assert (profile.source, profile.host_reads_link) == ("measured", True)  # the disk tier's
    assert (df["est_time_per_token_s"] > 0).all() and df["contended"].dtype == pl.Boolean
    # the disk's speed while each run read: all_resident reads nothing, so its pricing at the
    # run's disk is the pricing; a run that fetched read at its own time per expert
    assert meta["at_run_disk"]["reads"] > 0 and meta["disk_read_s"][ALL_RESIDENT] == [None]
    assert math.isnan(by[ALL_RESIDENT]["disk_read_s"])
    assert by[ALL_RESIDENT]["est_at_run_disk_s"] == by[ALL_RESIDENT]["est_time_per_token_s"]
    assert by["fetch_every_miss"]["disk_read_s"] == meta["disk_read_s"]["fetch_every_miss"][0] > 0
    # that speed against the calibration's reference run's, flagged beyond 15%
    reference_read_s = meta["at_run_disk"]["busy_s"] / meta["at_run_disk"]["reads"]
    # the disk's reference speed is a copy run's (the median's; one round here)
    assert meta["disk_read_s"]["cal_fetch"] == [pytest.approx(reference_read_s, rel=1e-12)]
    for row in df.iter_rows(named=True):
        ratio = row["disk_vs_calibration"]
        if row["policy"] == ALL_RESIDENT:
            assert math.isnan(ratio) and row["disk_drifted"] is False
            continue
        assert ratio == pytest.approx(row["disk_read_s"] / reference_read_s, rel=1e-12)
        assert row["disk_drifted"] == (abs(ratio - 1) > 0.15)
    assert (df["est_at_run_disk_s"] > 0).all()
    # at each run's own speed: all_resident only hits, every token probes the speed, so its
    # estimate there is its own mean (one round) and its error nil by construction
    res = by[ALL_RESIDENT]
    assert res["run_speed"] > 0
    assert res["est_at_run_speed_s"] == pytest.approx(res["time_per_token_mean_s"], rel=1e-9)
    assert (df["est_at_run_speed_s"] > 0).all()
    unprobed = df.filter(pl.col("run_speed").is_nan())  # too few tokens that only hit
    assert unprobed["est_at_run_speed_s"].to_list() == unprobed["est_at_run_disk_s"].to_list()
    assert ((df["cpu_share"] > 0) & (df["cpu_share"] <= 1)).all()
    # one round: no spread between rounds
    assert df["round_spread"].is_nan().all()
    # every run's per-token-layer counts beside the table: the validation runs' sum to their
    # rows' rates, and each stands for one run from fresh caches (T tokens x L layers x F)
    counts = read_bench_counts(tmp_path / "bench_token_layers.parquet")
    cmeta = read_metadata(tmp_path / "bench_token_layers.parquet")
    assert cmeta["fields"] == list(TOKEN_LAYER_FIELDS) and cmeta["capacity"] == 8
    assert cmeta["policies"]["speed"] == Policy(**STUDY_POLICIES["speed"]).to_dict()
    assert set(counts) == set(by) | {"cal_hits", "cal_fetch", "cal_host", "cal_admit",
                                     "cal_hits_1layer"}  # fmt: skip
    for name, runs in counts.items():
        (wall, c), L = runs[0], 1 if name == "cal_hits_1layer" else 2
        assert len(runs) == 1 and wall.shape == (30 if name in by else 64,) and (wall > 0).all()
        assert c.shape == (len(wall), L, len(TOKEN_LAYER_FIELDS)) and c.dtype == np.int16
        assert (c[..., :5].sum(-1) == 4).all()  # k experts per token-layer
        if name in by:
            per_status = c[..., :5].sum((0, 1))
            assert per_status[0] / per_status.sum() == pytest.approx(by[name]["hit_rate"])
    speed = counts["speed"][0][1]
    assert speed[..., TOKEN_LAYER_FIELDS.index("admission_requests")].sum() > 0
    # each calibration run's tokens priced at the fitted profile against their time
    errors = meta["calibration_run_errors"]
    assert set(errors) == set(counts) - set(by)
    costs = profile.price(ModelBytes(meta["expert_bytes"]))
    assert errors == pytest.approx(run_errors({n: counts[n] for n in errors}, costs), rel=1e-9)
    with pytest.raises(ValueError, match=r"params\.fraction: .*C=5, outside \[k=10"):
        BenchParams.from_dict({"fraction": 0.01})
    with pytest.raises(ValueError, match="unknown engine-bench"):
        BenchParams.from_dict({"layer": 2})
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"params\.threads={bad!r} \(engine-bench\)"):
            BenchParams.from_dict({"threads": bad})
    # the config's pin specs resolve at the benchmark's C = 128 (k = 10): "C-k" leaves k slots,
    # "C-5" too few; a planned allocation has no artefact here
    pinned = {"rule": "first_choice", "eviction": "lru", "pin": "C-k"}
    synthetic = {"routing": "synthetic"}
    assert BenchParams.from_dict({**synthetic, "policies": {"keep": pinned}}).policies == {
        "keep": pinned
    }
    with pytest.raises(ValueError, match=r"params.policies.keep: pin 'C-5' pins 123 of C_l=128"):
        BenchParams.from_dict({**synthetic, "policies": {"keep": {**pinned, "pin": "C-5"}}})
    with pytest.raises(ValueError, match="params.policies.p: a planned allocation"):
        planned = {"p": {"rule": "fetch_all", "allocation": "planned"}}
        BenchParams.from_dict({**synthetic, "policies": planned})


def test_benchmark_prices_a_pinned_policy(tmp_path):
    """A policy whose pin is a spec ("C-k") runs with its pins resolved at the bench's C and
    its row is priced with the resolved policy."""
    keep = {"rule": "first_choice", "eviction": "lru", "pin": "C-k"}
    params = dict(
        layers=2, num_experts=32, hidden=64, width=16, top_k=4, dtype="float32", tokens=20,
        warmup=2, calib_tokens=200, store_path=str(tmp_path / "b.bin"), progress=False,
        routing="synthetic", rounds=1,
        policies={"fetch_every_miss": STUDY_POLICIES["fetch_every_miss"], "keep": keep},
    )  # fmt: skip
    df = run_benchmark(params, "cpu", tmp_path / "bench.parquet")
    row = df.filter(pl.col("policy") == "keep").row(0, named=True)
    assert row["est_time_per_token_s"] > 0 and row["sub_rate"] > 0


def test_benchmark_keeps_all_residents_engine_across_its_rounds(tmp_path, monkeypatch):
    """all_resident's slots hold every expert and its runs only hit: one tier for its rounds,
    its slots loaded once; every other run's tier is its own, in the slot buffers of the one
    before it, and loaded for it; all closed."""
    params = dict(
        layers=2, num_experts=32, hidden=64, width=16, top_k=4, dtype="float32", tokens=9,
        warmup=2, calib_tokens=200, store_path=str(tmp_path / "b.bin"), progress=False,
        routing="synthetic", rounds=3,
        policies={"fetch_every_miss": {"rule": "fetch_all"}, ALL_RESIDENT: {"rule": "fetch_all"}},
    )  # fmt: skip
    tiers = recording_tiers(monkeypatch)
    df = run_benchmark(params, "cpu", tmp_path / "bench.parquet")
    full = [t for t in tiers if t.slots[0].capacity == 32]
    assert len(full) == 1 and full[0].loads == [0, 1]  # both layers, once
    assert len(tiers) == 1 + 3 * (1 + 5) and all(t.loads == [0, 1] for t in tiers)
    assert all(t.closed for t in tiers)
    # the others, each a fresh tier, are made in the slot buffers the one before them left
    others = [t for t in tiers if t not in full]
    first = [s.gate_up.data_ptr() for s in others[0].slots]
    assert all([s.gate_up.data_ptr() for s in t.slots] == first for t in others)
    counts = read_bench_counts(tmp_path / "bench_token_layers.parquet")
    assert [len(wall) for wall, _ in counts[ALL_RESIDENT]] == [3, 3, 3]
    assert df.filter(pl.col("policy") == ALL_RESIDENT)["hit_rate"].item() == 1.0


def test_benchmark_times_the_microbenchmarks_every_round(tmp_path):
    """The expert's time and both drags are measured in every round (on the slots of its first
    C-slot run) and the profile takes their medians, as the pipeline's calibration does."""
    params = dict(
        layers=2, num_experts=32, hidden=64, width=16, top_k=4, dtype="float32", tokens=12,
        warmup=2, calib_tokens=200, store_path=str(tmp_path / "b.bin"), progress=False,
        routing="synthetic", rounds=3, policies={"fetch_every_miss": {"rule": "fetch_all"}},
    )  # fmt: skip
    df = run_benchmark(params, "cpu", tmp_path / "bench.parquet")
    micro = read_metadata(tmp_path / "bench.parquet")["microbenchmarks"]
    assert len(micro["runs"]) == 3 and micro["runs"][0] != micro["runs"][1]
    # each round ran every run's next share of its measured tokens: 12 -> 4 + 4 + 4, a
    # calibration run's 64 -> 22 + 21 + 21, all of them in the row
    counts = read_bench_counts(tmp_path / "bench_token_layers.parquet")
    assert [len(wall) for wall, _ in counts["fetch_every_miss"]] == [4, 4, 4]
    assert [len(wall) for wall, _ in counts["cal_fetch"]] == [22, 21, 21]
    assert df["tokens"].to_list() == [12] and np.isfinite(df["round_spread"].to_numpy()).all()
    # each round left out in turn, the calibration refitted without it: one error per round
    for key in ("jackknife_rel_error", "calibration_jackknife_rel_error"):
        (errors,) = df[key].to_list()
        assert len(errors) == 3 and np.isfinite(errors).all()
    with pytest.raises(ValueError, match=r"params\.rounds=13: every round runs a share"):
        BenchParams.from_dict({**params, "rounds": 13})
    assert micro["median"] == {
        key: np.median([r[key] for r in micro["runs"]]) for key in micro["median"]
    }
    profile = read_metadata(tmp_path / "bench.parquet")["profile"]
    assert profile["host_read_drag"] == micro["median"]["host_read_drag"]
    # refitted offline from its saved tables, the bench gives its errors back
    # (benchmarks/bench_errors_over_benches.py, which pools many benches' errors)
    spec = importlib.util.spec_from_file_location(
        "bench_errors_over_benches", BENCHMARKS / "bench_errors_over_benches.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    now, stored = tool.refitted_errors(tmp_path / "bench.parquet")
    assert stored == {"fetch_every_miss": df["sim_rel_error"].item()}
    assert now["fetch_every_miss"] == pytest.approx(stored["fetch_every_miss"], rel=1e-9)


# ----------------------------------------------------------------------------------- CUDA
# every CUDA test runs on each device present: events and streams must be the tier's device's
CUDA_DEVICES = [
    pytest.param(
        f"cuda:{i}",
        marks=pytest.mark.skipif(torch.cuda.device_count() <= i, reason=f"needs {i + 1} GPU(s)"),
    )
    for i in range(2)
]


@pytest.mark.cuda
@pytest.mark.parametrize("device", CUDA_DEVICES)
@pytest.mark.parametrize("pinned_layers", [2, 1], ids=["pinned", "disk-behind"])
@pytest.mark.parametrize("rule", ["fetch_all", "threshold", "host_compute"])
def test_cuda_engine_matches_core_and_full_weights(tmp_path, rule, pinned_layers, device):
    """Pinned host -> GPU, and with a pinned budget of one layer the other read from disk
    through pinned bounce buffers (disk -> pinned -> GPU)."""
    lay = small_layout()
    E, k, C = lay.num_experts, 4, 6
    experts = write_random(tmp_path / "x.bin", lay)
    trace = synthetic_logits(40, lay.num_layers, E, seed=3)
    pol = Policy(rule=rule, tau=0.3)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    host = HostExperts(store, pinned_layers * E * lay.expert_bytes)
    assert host.pinned_layers == pinned_layers
    tier = CudaTier(host, C, torch.device(device), ACT)
    assert tier.kind == ("pinned->CUDA" if pinned_layers == 2 else "disk->pinned->CUDA")
    engine = OffloadEngine(tier, E, k, C, pol, None, ACT)
    try:
        status = drive(engine, trace, experts, E, lay.hidden)
    finally:
        engine.close()
    assert np.array_equal(status, scan(trace, k, C, pol).status)


@pytest.mark.cuda
@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_cuda_background_admission_and_decode(stage, tmp_path, device):
    captured = pl.read_parquet(stage / "tokens.parquet")["nll"].to_numpy()
    fem = {"rule": "fetch_all"}
    df, meta = engine_run(stage, "fetch_every_miss", fem, tmp_path, device, dtype="float32")
    assert meta["tier_kind"] == "pinned->CUDA" and meta["device"] == device
    ok = ~np.isnan(captured)
    np.testing.assert_allclose(df["nll"].to_numpy()[ok], captured[ok], rtol=0, atol=1e-4)
    # one wait per layer (the router's values) and one at the token's end
    assert (df["syncs"] == L_M + 1).all()
    spec = {"rule": "first_choice", "eviction": "lfu", "beta": 0.5}
    bf16 = {"store_path": str(tmp_path / "experts-bf16.bin")}
    df, meta = engine_run(stage, "speed", spec, tmp_path, device, **bf16)  # bf16 by default
    assert meta["dtype"] == "bfloat16" and (df["syncs"] == L_M + 1).all()
    assert df["sub"].sum() > 0 and df["bytes_bg"].sum() > 0
    assert meta["admit_latency_tokens_mean"] >= 1
    # a pinned budget below one layer: every layer read from disk through pinned memory
    df, meta = engine_run(stage, "speed", spec, tmp_path, device, pinned_budget_gb=0, **bf16)
    assert meta["tier_kind"] == "disk->pinned->CUDA" and df["bytes_bg"].sum() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("device", CUDA_DEVICES)
def test_cuda_grouped_kernel_matches_per_expert_bf16(device):
    """Real shapes (Qwen3-Next-80B experts: H=2048, I=512, C=128 slots, top-10), bf16: the
    grouped kernel, where the device has it, against the per-expert path."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    C, H, I, k = 128, 2048, 512, 10
    gate_up = (torch.randn(C, 2 * I, H, generator=g, device=dev) * H**-0.5).bfloat16()
    down = (torch.randn(C, H, I, generator=g, device=dev) * I**-0.5).bfloat16()
    hidden = torch.randn(1, H, generator=g, device=dev).bfloat16()
    ids = np.random.default_rng(0).choice(C, size=(1, k), replace=False)
    ids[0, 3] = -1  # a host-computed rank
    weights = torch.softmax(torch.randn(1, k, generator=g, device=dev), -1).bfloat16()
    ref = expert_forward(hidden, ids, weights, gate_up, down, ACT, "per_expert")
    if choose_path(dev, torch.bfloat16) != "grouped":
        pytest.skip(f"{torch.cuda.get_device_name(dev)}: no fast grouped kernel")
    out = expert_forward(hidden, ids, weights, gate_up, down, ACT, "grouped")
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
