"""Fast-tier expert slots and the two memory tiers of the engine.

A tier owns, per MoE layer, `C` preallocated expert slots in fast memory (`SlotBuffers`) and the
way experts reach them from the slow tier:

- `DiskTier` (CPU-only machines): the slow tier is an `ExpertStore` file, the fast tier RAM.
  Synchronous fetches are blocking uncached reads straight into the slot; background admissions
  are read by an I/O thread into staging buffers, and installed into the slot the policy core
  names once the read has really completed.
- `CudaTier`: the slow tier is pinned host memory (one contiguous `[2I, H]` + `[H, I]` buffer per
  expert), the fast tier the GPU. Synchronous fetches are host->device copies on the compute
  stream (blocked time measured with CUDA events); admissions are copied on a side stream into
  GPU staging buffers and installed (device->device) once their event has completed.

Both tiers also compute `host_compute` misses on the host processor from host weights (on the
disk tier every such miss is a fresh uncached read of the expert: "host weights" live on disk).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moesub.engine.kernels import grouped_experts
from moesub.engine.store import ExpertStore, StoreLayout, aligned_empty


@dataclass
class SlotBuffers:
    """One layer's C expert slots in fast memory."""

    gate_up: torch.Tensor  # (C, 2I, H)
    down: torch.Tensor  # (C, H, I)

    @property
    def capacity(self) -> int:
        return self.gate_up.shape[0]


def _host_ids_to_local(host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """host_ids (N, k) expert or -1 -> (local index (N, k) or -1, experts (n,) in local order)."""
    flat = host_ids.reshape(-1)
    experts, inverse = np.unique(flat[flat >= 0], return_inverse=True)
    local = np.full(flat.shape, -1, dtype=np.int64)
    local[flat >= 0] = inverse
    return local.reshape(host_ids.shape), experts


# ------------------------------------------------------------------------------------ disk tier


class BackgroundReader:
    """An I/O thread that reads requested experts from the store into staging buffers.

    `submit(layer, expert)` enqueues a read; `poll(layer)` returns `(expert, buffer)` for every
    read of that layer that has completed; the caller installs the buffer and `release`s it.
    Reads wait for a free staging buffer, so at most `num_buffers` admissions are in flight.
    """

    def __init__(self, store: ExpertStore, num_buffers: int) -> None:
        if num_buffers < 1:
            raise ValueError(f"staging_buffers must be >= 1, got {num_buffers}")
        lay = store.layout
        self.store = store
        self.buffers = [
            (
                aligned_empty(lay.gate_up_shape, lay.torch_dtype),
                aligned_empty(lay.down_shape, lay.torch_dtype),
            )
            for _ in range(num_buffers)
        ]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(num_buffers):
            self._free.put(i)
        self._requests: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._done = [collections.deque() for _ in range(lay.num_layers)]  # per layer
        self._busy = threading.Event()  # a request is being served
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="moesub-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            self._busy.set()
            try:
                layer, expert = item
                idx = self._free.get()
                gu, dn = self.buffers[idx]
                nbytes = self.store.read_into(layer, expert, gu, dn)
                self._done[layer].append((expert, idx, nbytes))
            except BaseException as e:  # surfaced to the main thread on the next poll
                self._error = e
            finally:
                self._busy.clear()
                self._requests.task_done()

    def submit(self, layer: int, expert: int) -> None:
        self._requests.put((layer, expert))

    def poll(self, layer: int) -> list[tuple[int, int, int]]:
        """(expert, buffer index, bytes) of every completed read of `layer`."""
        if self._error is not None:
            raise RuntimeError(f"background expert read failed: {self._error}") from self._error
        done = self._done[layer]
        out = []
        while done:
            out.append(done.popleft())
        return out

    def release(self, idx: int) -> None:
        self._free.put(idx)

    def drain(self) -> None:
        """Wait for every submitted read, then discard the results (stream boundary)."""
        while self._requests.unfinished_tasks:
            # reads block on a free buffer: keep releasing finished ones while waiting
            for layer in range(len(self._done)):
                for _e, idx, _n in self.poll(layer):
                    self.release(idx)
            time.sleep(0.0005)
        for layer in range(len(self._done)):
            for _e, idx, _n in self.poll(layer):
                self.release(idx)

    def close(self) -> None:
        if self._thread.is_alive():
            self.drain()
            self._requests.put(None)
            self._thread.join(timeout=30)


class DiskTier:
    """Experts on disk (`ExpertStore`), C slots per layer in RAM."""

    kind = "disk->RAM"

    def __init__(
        self,
        store: ExpertStore,
        capacity: int,
        k: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        staging_buffers: int = 4,
    ) -> None:
        lay: StoreLayout = store.layout
        self.store, self.layout, self.act = store, lay, act
        self.device = torch.device("cpu")
        dt = lay.torch_dtype
        self.slots = [
            SlotBuffers(
                aligned_empty((capacity, *lay.gate_up_shape), dt),
                aligned_empty((capacity, *lay.down_shape), dt),
            )
            for _ in range(lay.num_layers)
        ]
        # scratch for host_compute misses: up to k experts of one token, read fresh every time
        self._host_gu = aligned_empty((k, *lay.gate_up_shape), dt)
        self._host_dn = aligned_empty((k, *lay.down_shape), dt)
        self.reader = BackgroundReader(store, staging_buffers)
        self._wait_s = 0.0

    @property
    def description(self) -> str:
        return (
            f"disk->RAM: experts read from {self.store.path.name} with {self.store.mode} "
            "(page cache bypassed); host_compute misses computed on the CPU from a fresh "
            "uncached disk read per miss"
        )

    def load(self, layer: int, resident: np.ndarray) -> None:
        """Fill the slots with `resident` (C,) experts (-1 = leave empty); not timed."""
        s = self.slots[layer]
        for slot, e in enumerate(resident.tolist()):
            if e >= 0:
                self.store.read_into(layer, e, s.gate_up[slot], s.down[slot])

    def fetch(self, layer: int, pairs: Sequence[tuple[int, int]]) -> int:
        """Synchronously copy experts into slots: pairs of (expert, slot). Returns bytes."""
        s = self.slots[layer]
        n = 0
        t0 = time.perf_counter()
        for e, slot in pairs:
            n += self.store.read_into(layer, e, s.gate_up[slot], s.down[slot])
        self._wait_s += time.perf_counter() - t0
        return n

    def request(self, layer: int, expert: int) -> None:
        self.reader.submit(layer, expert)

    def completed(self, layer: int) -> list[tuple[int, int, int]]:
        return self.reader.poll(layer)

    def install(self, layer: int, handle: tuple[int, int, int], slot: int) -> int:
        _e, idx, nbytes = handle
        gu, dn = self.reader.buffers[idx]
        s = self.slots[layer]
        s.gate_up[slot].copy_(gu)
        s.down[slot].copy_(dn)
        self.reader.release(idx)
        return nbytes

    def discard(self, handle: tuple[int, int, int]) -> None:
        self.reader.release(handle[1])

    def host_forward(
        self, layer: int, hidden: torch.Tensor, host_ids: np.ndarray, weights: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Misses computed on the CPU, each from a fresh uncached disk read. -> (out, bytes)."""
        local, experts = _host_ids_to_local(host_ids)
        n = 0
        t0 = time.perf_counter()
        for j, e in enumerate(experts.tolist()):
            n += self.store.read_into(layer, e, self._host_gu[j], self._host_dn[j])
        self._wait_s += time.perf_counter() - t0
        ids = torch.from_numpy(local)
        out = grouped_experts(
            hidden, ids, weights, self._host_gu[: len(experts)], self._host_dn[: len(experts)],
            self.act,
        )  # fmt: skip
        return out, n

    def take_wait_s(self) -> float:
        w, self._wait_s = self._wait_s, 0.0
        return w

    def synchronize(self) -> None:
        pass

    def drain(self) -> None:
        self.reader.drain()

    def close(self) -> None:
        self.reader.close()


# ------------------------------------------------------------------------------------ CUDA tier


def require_cuda(device: str | torch.device) -> torch.device:
    """The torch device for `device`, or ValueError if CUDA was requested but is absent."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda[:n]' ({e})") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}: CUDA was requested but no CUDA device is available "
                "(use device='cpu' for the disk->RAM tier)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: only {torch.cuda.device_count()} GPUs")
    elif dev.type != "cpu":
        raise ValueError(f"device={str(device)!r}: expected 'cpu' or 'cuda[:n]'")
    return dev


def pinned_from_store(store: ExpertStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's experts read from a store into pinned host memory ((E,2I,H), (E,H,I))."""
    lay = store.layout
    gu = torch.empty((lay.num_experts, *lay.gate_up_shape), dtype=lay.torch_dtype).pin_memory()
    dn = torch.empty((lay.num_experts, *lay.down_shape), dtype=lay.torch_dtype).pin_memory()
    for e in range(lay.num_experts):
        store.read_into(layer, e, gu[e], dn[e])
    return gu, dn


class CudaTier:
    """Experts in pinned host memory, C slots per layer on the GPU, admissions on a side stream."""

    kind = "pinned->CUDA"

    def __init__(
        self,
        host: list[tuple[torch.Tensor, torch.Tensor]],
        capacity: int,
        device: torch.device,
        act: Callable[[torch.Tensor], torch.Tensor],
        staging_buffers: int = 4,
    ) -> None:
        require_cuda(device)
        if staging_buffers < 1:
            raise ValueError(f"staging_buffers must be >= 1, got {staging_buffers}")
        self.device, self.act = device, act
        self.host = []
        for gu, dn in host:  # (E, 2I, H), (E, H, I)
            if not gu.is_pinned():
                gu = gu.contiguous().pin_memory()
            if not dn.is_pinned():
                dn = dn.contiguous().pin_memory()
            self.host.append((gu, dn))
        gu0, dn0 = self.host[0]
        self.expert_bytes = gu0[0].nbytes + dn0[0].nbytes
        self.slots = [
            SlotBuffers(
                torch.empty((capacity, *gu0.shape[1:]), dtype=gu0.dtype, device=device),
                torch.empty((capacity, *dn0.shape[1:]), dtype=dn0.dtype, device=device),
            )
            for _ in self.host
        ]
        self.side = torch.cuda.Stream(device=device)
        self.staging = [
            (
                torch.empty(gu0.shape[1:], dtype=gu0.dtype, device=device),
                torch.empty(dn0.shape[1:], dtype=dn0.dtype, device=device),
            )
            for _ in range(staging_buffers)
        ]
        self._staging_free_ev = [None] * staging_buffers  # event: last install from it done
        self._free = list(range(staging_buffers))
        self._queued: collections.deque[tuple[int, int]] = collections.deque()
        self._inflight: collections.defaultdict[int, collections.deque] = collections.defaultdict(
            collections.deque
        )
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def description(self) -> str:
        return (
            "pinned->CUDA: experts in pinned host memory, C slots per layer on the GPU, "
            "admissions on a side CUDA stream; host_compute misses computed on the CPU from "
            "pinned host weights"
        )

    def load(self, layer: int, resident: np.ndarray) -> None:
        gu, dn = self.host[layer]
        s = self.slots[layer]
        for slot, e in enumerate(resident.tolist()):
            if e >= 0:
                s.gate_up[slot].copy_(gu[e], non_blocking=True)
                s.down[slot].copy_(dn[e], non_blocking=True)
        torch.cuda.synchronize(self.device)

    def fetch(self, layer: int, pairs: Sequence[tuple[int, int]]) -> int:
        """H2D copies on the compute stream (the compute that follows waits for them)."""
        if not pairs:
            return 0
        gu, dn = self.host[layer]
        s = self.slots[layer]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for e, slot in pairs:
            s.gate_up[slot].copy_(gu[e], non_blocking=True)
            s.down[slot].copy_(dn[e], non_blocking=True)
        end.record()
        self._events.append((start, end))
        return len(pairs) * self.expert_bytes

    def _launch(self, layer: int, expert: int, idx: int) -> None:
        gu, dn = self.host[layer]
        sg, sd = self.staging[idx]
        with torch.cuda.stream(self.side):
            ev = self._staging_free_ev[idx]
            if ev is not None:
                self.side.wait_event(ev)  # the previous install from this buffer has run
            sg.copy_(gu[expert], non_blocking=True)
            sd.copy_(dn[expert], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        self._inflight[layer].append((expert, idx, done))

    def request(self, layer: int, expert: int) -> None:
        if self._free:
            self._launch(layer, expert, self._free.pop())
        else:
            self._queued.append((layer, expert))

    def completed(self, layer: int) -> list[tuple[int, int, int]]:
        out = []
        q = self._inflight[layer]
        while q and q[0][2].query():
            expert, idx, _ = q.popleft()
            out.append((expert, idx, self.expert_bytes))
        return out

    def _release(self, idx: int) -> None:
        ev = torch.cuda.Event()
        ev.record()  # on the compute stream, after the install copy
        self._staging_free_ev[idx] = ev
        if self._queued:
            layer, expert = self._queued.popleft()
            self._launch(layer, expert, idx)
        else:
            self._free.append(idx)

    def install(self, layer: int, handle: tuple[int, int, int], slot: int) -> int:
        _e, idx, nbytes = handle
        sg, sd = self.staging[idx]
        s = self.slots[layer]
        s.gate_up[slot].copy_(sg, non_blocking=True)
        s.down[slot].copy_(sd, non_blocking=True)
        self._release(idx)
        return nbytes

    def discard(self, handle: tuple[int, int, int]) -> None:
        self._release(handle[1])

    def host_forward(
        self, layer: int, hidden: torch.Tensor, host_ids: np.ndarray, weights: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Misses computed on the CPU straight from the pinned host weights (no copy)."""
        gu, dn = self.host[layer]
        h = hidden.to("cpu")  # synchronizes: the host needs the hidden state
        out = grouped_experts(
            h, torch.from_numpy(np.ascontiguousarray(host_ids, dtype=np.int64)),
            weights.to("cpu"), gu, dn, self.act,
        )  # fmt: skip
        return out.to(self.device, non_blocking=True), 0

    def take_wait_s(self) -> float:
        """Seconds the compute stream spent on synchronous copies since the last call."""
        torch.cuda.synchronize(self.device)
        w = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        self._events.clear()
        return w

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def drain(self) -> None:
        """Discard every queued and in-flight admission (stream boundary)."""
        self._queued.clear()
        torch.cuda.synchronize(self.device)
        for layer in list(self._inflight):
            for h in self.completed(layer):
                self.discard(h)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.drain()
