"""moesub.engine without a GPU: what the CUDA tier is made of, tested on the CPU.

- the expert kernel: the path chosen from device capability and dtype (a fake capability), both
  paths equal, and no device->host round trip inside (`nonzero`, `bincount`, `.item()`);
- host memory: the pinned budget (the allocator injected: pinned allocation is the only CUDA
  step), layers past it read from disk, and the set-up's peak host memory measured in a fresh
  process with experts larger than the budget;
- the engine's admission bookkeeping: staging buffers released at the start of each token (all
  layers), admission latency in tokens, and host waits per token counted through the seam.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moesub.engine.host_memory import CountingAllocator, HostExperts, layers_within
from moesub.engine.kernels import ExpertPlan, choose_path, expert_forward
from moesub.engine.runtime import OffloadEngine
from moesub.engine.store import ExpertStore, StoreLayout, random_experts, write_store
from moesub.engine.tiers import DiskTier
from moesub.policy import Policy, scan
from moesub.synthetic import synthetic_logits

ACT = torch.nn.functional.silu
CUDA = torch.device("cuda:0")  # only named, never allocated on: choose_path takes a capability


# ----------------------------------------------------------------------------------- kernels
def test_kernel_path_by_capability_and_dtype():
    bf16, f32 = torch.bfloat16, torch.float32
    assert choose_path(CUDA, bf16, capability=(9, 0)) == "grouped"  # H100 / H200
    assert choose_path(CUDA, bf16, capability=(10, 0)) == "grouped"  # B200
    assert choose_path(CUDA, bf16, capability=(8, 9)) == "per_expert"  # consumer Ada
    assert choose_path(CUDA, bf16, capability=(12, 0)) == "per_expert"  # consumer Blackwell
    assert choose_path(CUDA, f32, capability=(9, 0)) == "per_expert"  # fp32: torch's fallback
    assert choose_path(torch.device("cpu"), bf16) == "per_expert"


def _slots(G=8, H=32, I=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(G, 2 * I, H, generator=g) * 0.2, torch.randn(G, H, I, generator=g) * 0.3


def test_both_paths_compute_the_same_experts():
    gate_up, down = _slots()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 32, generator=g)
    ids = np.array([[5, 1, -1], [1, 1, 7], [-1, -1, -1]])
    weights = torch.rand(3, 3, generator=g)
    a = expert_forward(hidden, ids, weights, gate_up, down, ACT, "per_expert")
    b = expert_forward(hidden, ids, weights, gate_up, down, ACT, "grouped")  # torch runs it on CPU
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ref = torch.zeros(3, 32)
    for n in range(3):
        for j in range(3):
            if ids[n, j] >= 0:
                gg, u = (gate_up[ids[n, j]] @ hidden[n]).chunk(2)
                ref[n] += weights[n, j] * (down[ids[n, j]] @ (ACT(gg) * u))
    torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[2], torch.zeros(32))
    plan = ExpertPlan.of(ids, 8)
    assert plan.groups.tolist() == [1, 1, 1, 5, 7] and plan.offs[-1] == 5
    with pytest.raises(ValueError, match="group 9"):
        ExpertPlan.of(np.array([[9]]), 8)
    with pytest.raises(ValueError, match="kernel path 'gather'"):
        expert_forward(hidden, ids, weights, gate_up, down, ACT, "gather")


class _Ops(TorchDispatchMode):
    """Records every aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["per_expert", "grouped"])
def test_expert_kernel_has_no_device_round_trip(path):
    """Ops whose result size or value the host must wait for on a GPU never run in the kernel:
    the plan is made on the host from host ids."""
    gate_up, down = _slots()
    hidden, weights = torch.randn(2, 32), torch.rand(2, 3)
    ids = np.array([[5, 1, -1], [2, 1, 7]])
    with _Ops() as rec:
        expert_forward(hidden, ids, weights, gate_up, down, ACT, path)
    assert rec.ops and not rec.ops & {"nonzero", "bincount", "_local_scalar_dense", "unique"}


# ----------------------------------------------------------------------------------- memory
def small_store(tmp_path: Path, L=4, E=8, H=64, I=16) -> tuple[ExpertStore, list]:
    lay = StoreLayout(L, E, H, I, "float32", fingerprint="test")
    experts = [(gu.clone(), dn.clone()) for gu, dn in random_experts(lay, 0)]
    write_store(tmp_path / "x.bin", lay, iter(experts), progress=False)
    return ExpertStore(tmp_path / "x.bin", expected=lay), experts


def test_pinned_budget_puts_the_other_layers_on_disk(tmp_path):
    store, experts = small_store(tmp_path)
    lay = store.layout
    layer_bytes = lay.num_experts * lay.expert_bytes
    alloc = CountingAllocator()
    host = HostExperts(store, int(2.5 * layer_bytes), alloc)
    assert host.pinned_layers == 2 and host.disk_layers == [2, 3]
    assert alloc.bytes == host.pinned_bytes == 2 * layer_bytes  # allocated once, within budget
    assert "2 of 4 layers in pinned host memory" in host.describe()
    gu, dn = torch.empty(lay.gate_up_shape), torch.empty(lay.down_shape)
    for layer, e in [(0, 3), (1, 7), (2, 0), (3, 5)]:  # pinned copies and disk reads alike
        nbytes = host.read_into(layer, e, gu, dn)
        assert torch.equal(gu, experts[layer * lay.num_experts + e][0])
        assert torch.equal(dn, experts[layer * lay.num_experts + e][1])
        assert nbytes == (lay.expert_bytes if host.on_disk(layer) else 0)
    assert torch.equal(host.layer(1)[0][7], experts[lay.num_experts + 7][0])
    with pytest.raises(ValueError, match="layer 3 is on disk"):
        host.layer(3)
    assert layers_within(lay, None) == 4 and layers_within(lay, 0) == 0
    with pytest.raises(ValueError, match=">= 0"):
        layers_within(lay, -1)
    with pytest.raises(ValueError, match="no expert store for the others"):
        HostExperts(None, 0, alloc, layout=lay, fill=lambda *a: None)
    store.close()


PEAK_SCRIPT = """
import json, os, sys, threading
import torch
from moesub.engine.host_memory import CountingAllocator, HostExperts
from moesub.engine.store import ExpertStore

PAGE = os.sysconf("SC_PAGE_SIZE")

def rss():  # resident set size now, in bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE

store = ExpertStore(sys.argv[1])
torch.empty(1)
before, peak, done = rss(), [0], threading.Event()

def sample():  # the high-water mark of the set-up, sampled every millisecond
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        done.wait(0.001)

t = threading.Thread(target=sample)
t.start()
alloc = CountingAllocator()
host = HostExperts(store, int(sys.argv[2]), alloc)
done.set()
t.join()
peak[0] = max(peak[0], rss())
print(json.dumps({"peak_delta": peak[0] - before, "allocated": alloc.bytes,
                  "pinned_layers": host.pinned_layers}))
"""


def test_setup_peak_host_memory_stays_within_budget(tmp_path):
    """Experts of 8 layers (200 MiB) behind a 60 MiB budget: the set-up's peak host memory
    (resident set size of a fresh process, sampled every millisecond) grows by at most the
    budget plus one layer, and by at least what was allocated (the measurement sees it)."""
    lay = StoreLayout(8, 64, 256, 128, "float32", fingerprint="big")
    layer_bytes = lay.num_experts * lay.expert_bytes  # 25 MiB
    write_store(tmp_path / "big.bin", lay, random_experts(lay, 0), progress=False)
    budget = 60 * 2**20
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PEAK_SCRIPT), str(tmp_path / "big.bin"),
         str(budget)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["pinned_layers"] == 2 and r["allocated"] == 2 * layer_bytes
    assert r["peak_delta"] <= budget + layer_bytes, r
    assert r["peak_delta"] >= r["allocated"] * 0.9, r  # the measurement sees the buffers


# ----------------------------------------------------------------------------------- engine
def test_admissions_install_at_token_start_with_latency_and_syncs(tmp_path):
    """admission="completion": completed copies of every layer are installed when a token
    begins (so staging buffers free up once per token, not at the layer's next route); each
    installed admission's latency is counted in tokens; host waits per token are one per layer
    (the router's values) plus the token's end."""
    store, _ = small_store(tmp_path, L=3, E=16)
    k, C, L = 4, 6, 3
    trace = synthetic_logits(60, L, 16, seed=2)
    tier = DiskTier(store, C, k, ACT, staging_buffers=2)
    engine = OffloadEngine(
        tier, 16, k, C, Policy(rule="first_choice", eviction="lfu", beta=0.5), None, ACT
    )
    admitted = latency = 0
    try:
        for t in range(trace.shape[0]):
            engine.begin_token()
            for layer in range(L):
                engine.to_host(layer, torch.from_numpy(trace[t, layer][None]))
                engine.route(layer, trace[t, layer][None])
            st = engine.end_token()
            assert st.syncs == L + 1
            admitted += st.admitted
            latency += st.admit_latency
        installed = sum(c.counters()["admissions"] for c in engine.caches)
    finally:
        engine.close()
    assert admitted > 0 and admitted <= installed
    assert latency >= admitted  # at least the next token


# ----------------------------------------------------------------------------------- CUDA tier
class FakeEvent:
    """A CUDA event on the CPU: complete after `lag` queries (copies "in flight" for a while)."""

    lag = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self._left, self.t = FakeEvent.lag, 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        if self._left > 0:
            self._left -= 1
            return False
        return True

    def synchronize(self) -> None:
        self._left = 0

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.t - self.t) * 1e3


class FakeStream:
    def __init__(self, device=None) -> None:
        self.waits = 0

    def wait_event(self, event: FakeEvent) -> None:
        self.waits += 1


class FakeCuda:
    """The torch.cuda calls the CUDA tier makes, on the CPU (copies run at once; events lag)."""

    Event = FakeEvent
    Stream = FakeStream

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.device_syncs = 0  # whole-device synchronizations (set-up and drains only)

    def current_stream(self, device=None) -> FakeStream:
        return self.compute

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        yield

    def synchronize(self, device=None) -> None:
        self.device_syncs += 1

    def get_device_name(self, device=None) -> str:
        return "fake"


@pytest.mark.parametrize("lag", [0, 3], ids=["instant", "lagging"])
@pytest.mark.parametrize("pinned_layers", [2, 1, 0])
@pytest.mark.parametrize(
    "policy,admission",
    [
        ({"rule": "fetch_all"}, "completion"),
        ({"rule": "host_compute"}, "completion"),
        ({"rule": "first_choice", "eviction": "lfu", "beta": 0.5}, "delay"),
    ],
    ids=["fetch_all", "host_compute", "admissions"],
)
def test_cuda_tier_bookkeeping_on_a_fake_device(tmp_path, monkeypatch, policy, admission,
                                                pinned_layers, lag):  # fmt: skip
    """The CUDA tier's logic (pinned layers and layers on disk behind a budget, bounce buffers,
    admissions through pinned reads and staging buffers, events that complete late) run on
    the CPU: decisions are the core's own scan, every output the full-weight reference's."""
    from test_engine import ACT as act
    from test_engine import drive, small_layout, write_random

    from moesub.engine.cuda_tier import CudaTier

    monkeypatch.setattr(FakeEvent, "lag", lag)
    lay = small_layout()
    E, k, C = lay.num_experts, 4, 6
    experts = write_random(tmp_path / "x.bin", lay)
    store = ExpertStore(tmp_path / "x.bin", expected=lay)
    host = HostExperts(store, pinned_layers * E * lay.expert_bytes, CountingAllocator())
    cuda = FakeCuda()
    tier = CudaTier(host, C, "cpu", act, staging_buffers=3, alloc=host.alloc, cuda=cuda, top_k=k)
    assert tier.kind == ("pinned->CUDA" if pinned_layers == 2 else "disk->pinned->CUDA")
    # the host's scratch for layers on disk: k experts, written at set-up, never reallocated
    scratch = tier._host_scratch
    assert (scratch is None) == (pinned_layers == 2)
    pol = Policy(**policy)
    trace = synthetic_logits(60, lay.num_layers, E, seed=3)
    engine = OffloadEngine(tier, E, k, C, pol, None, act, admission=admission)
    try:
        device_syncs = cuda.device_syncs
        status = drive(engine, trace, experts, E, lay.hidden)
        # tokens wait for the compute stream only, never the whole device
        assert cuda.device_syncs == device_syncs
        installed = sum(c.counters()["admissions"] for c in engine.caches)
    finally:
        engine.close()
    assert np.array_equal(status, scan(trace, k, C, pol).status)
    assert tier._host_scratch is scratch and (scratch is None or len(scratch[0]) == k)
    if admission == "delay":
        assert installed > 0
    assert not tier._queued and all(not q for q in tier._inflight)  # drained on close
    assert sorted(tier._free) == list(range(3))


def test_build_drops_the_models_experts_before_the_tier(tmp_path, monkeypatch):
    """`load_engine_model` keeps no reference to the loaded model's expert weights once the
    store is written, before the tier allocates: the host never holds them next to the tier's
    copy (pinned memory or slots)."""
    import gc
    import weakref

    from test_engine import tiny_model

    import moesub.models
    from moesub.engine import adapter
    from moesub.engine.spec import EngineParams

    tiny_model().save_pretrained(tmp_path / "model")
    real_load, loaded = moesub.models.load_model, []

    def load_and_watch(*args, **kwargs):
        model, tok = real_load(*args, **kwargs)
        for block in moesub.models.moe_blocks(model):
            gate_up, down = moesub.models.moe_family(model).expert_weights(block)
            loaded.extend([weakref.ref(gate_up), weakref.ref(down)])
        return model, tok

    alive_at_tier = []

    def tier_after_check(*args, **kwargs):  # what is still alive when the tier allocates
        gc.collect()
        alive_at_tier.append(sum(ref() is not None for ref in loaded))
        return DiskTier(*args, **kwargs)

    monkeypatch.setattr(moesub.models, "load_model", load_and_watch)
    monkeypatch.setattr(adapter, "DiskTier", tier_after_check)
    opts = EngineParams(store_path=str(tmp_path / "experts.bin"), progress=False)
    model = adapter.load_engine_model(tmp_path / "model", "cpu", opts)
    setup = adapter.build_engine_model(model, "cpu", opts, capacity=None)
    try:
        assert loaded and alive_at_tier == [0]  # every expert weight freed before the tier
        assert (tmp_path / "experts.bin").is_file()
    finally:
        setup.tier.close()
        model.close()


def test_build_checks_the_capacity_before_the_store(tmp_path):
    """k <= C <= E (`check_capacity`), checked before the expert store is written."""
    from test_engine import tiny_model

    from moesub.engine.adapter import load_engine_model
    from moesub.engine.spec import EngineParams

    tiny_model().save_pretrained(tmp_path / "model")
    opts = EngineParams(store_path=str(tmp_path / "experts.bin"), progress=False)
    with pytest.raises(ValueError, match=r"cache capacity 3 \(E=16, k=4\): .*C=3, outside \[k=4"):
        load_engine_model(tmp_path / "model", "cpu", opts, capacity=3)
    with pytest.raises(ValueError, match=r"cache capacity 17 \(E=16, k=4\)"):
        load_engine_model(tmp_path / "model", "cpu", opts, capacity=17)
    assert not (tmp_path / "experts.bin").exists()


def test_engines_share_one_loaded_model(tmp_path):
    """Engines built one after another on one loaded model (`load_engine_model`): each gets a
    tier of its own on the shared store, and the model keeps its store open between them; an
    engine asking for other options than the model was loaded with is refused."""
    from test_engine import tiny_model

    from moesub.engine.adapter import build_engine_model, load_engine_model
    from moesub.engine.spec import EngineParams

    tiny_model().save_pretrained(tmp_path / "model")
    opts = EngineParams(store_path=str(tmp_path / "experts.bin"), progress=False)
    loaded = load_engine_model(tmp_path / "model", "cpu", opts, capacity=4)
    try:
        first = build_engine_model(loaded, "cpu", opts, 4)
        first.tier.close()
        second = build_engine_model(loaded, "cpu", opts, [4, 8])
        assert second.tier is not first.tier and second.tier.store is loaded.store
        assert second.model is loaded.model and second.experts[0] is not first.experts[0]
        second.tier.close()
        with pytest.raises(ValueError, match=r"loaded model has \(device, dtype, pinned_budget"):
            build_engine_model(loaded, "cpu", EngineParams(dtype="bfloat16"), 4)
    finally:
        loaded.close()


@pytest.mark.parametrize("pinned_layers", [2, 0], ids=["pinned", "disk"])
def test_install_microbenchmark_on_the_cuda_tier(tmp_path, monkeypatch, pinned_layers):
    """The install microbenchmark drives the CUDA tier (CPU stand-in, copies whose events land
    late) as it drives the disk tier: each copy waited for until it has landed, installed into
    a loaded slot, which then holds that expert's weights; every staging buffer free after."""
    from test_engine import ACT as act
    from test_engine import small_layout, write_random

    from moesub.engine.cuda_tier import CudaTier
    from moesub.engine.microbench import measure_install

    monkeypatch.setattr(FakeEvent, "lag", 3)
    lay = small_layout()
    experts = write_random(tmp_path / "x.bin", lay)
    budget = pinned_layers * lay.num_experts * lay.expert_bytes
    host = HostExperts(ExpertStore(tmp_path / "x.bin", expected=lay), budget, CountingAllocator())
    tier = CudaTier(host, 6, "cpu", act, staging_buffers=3, alloc=host.alloc, cuda=FakeCuda())
    installs = []
    real = tier.install
    monkeypatch.setattr(
        tier, "install", lambda l, h, s: installs.append((h[0], s)) or real(l, h, s)
    )
    try:
        tier.slots[0].gate_up.zero_()
        tier.load(0, np.array([1, 3, 5, -1, -1, -1], np.int32))
        assert measure_install(tier, reps=4) > 0.0
        assert len(installs) == 4 and all(slot in (0, 1, 2) for _e, slot in installs)
        for slot, expert in dict((s, e) for e, s in installs).items():
            gate_up, down = experts[expert]  # layer 0's
            torch.testing.assert_close(tier.slots[0].gate_up[slot], gate_up, rtol=0, atol=0)
            torch.testing.assert_close(tier.slots[0].down[slot], down, rtol=0, atol=0)
        assert len(tier._free) == len(tier.staging)
    finally:
        tier.close()
