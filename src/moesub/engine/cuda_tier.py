"""The CUDA tier: C_l slots for layer l on the GPU; behind them every expert in host memory (pinned,
within a budget) or, past the budget, in the expert store on disk (`HostExperts`).

Streams and events, all on the tier's own device (never the current device, so `cuda:1` works):
- the compute stream (`torch.cuda.current_stream(device)`, the model's): synchronous fetches
  (host -> device copies the next kernels wait for, timed with events), installs of admissions
  (device -> device), the expert kernels;
- a side stream for background copies (admissions, prefetches): host -> GPU staging buffer;
  the compute stream never waits for it. A copy is installed once its event has completed
  (polled by the engine), and its staging buffer is reused by the side stream only after the
  install has run (an event the side stream waits on, on the device).
A token ends by waiting for an event on the compute stream only (`token_sync`): background
copies keep running into the next tokens.

Layers on disk (disk -> pinned -> GPU): a synchronous fetch reads the expert into a pinned
bounce buffer and copies it; an admission is read by an I/O thread into a pinned buffer, then
copied on the side stream into GPU staging like any other admission.

Host-device traffic per layer: the router's values come to the host once (`to_host`: copies into
pinned buffers, one event, one counted wait); index arrays go up through a pinned buffer
(`upload`, no wait); host_compute results go back through pinned memory (no wait). These pinned
buffers belong to one layer and are reused at its next token, after `token_sync` has waited for
the compute stream, so no copy out of them can still be pending.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from moesub.engine.host_memory import Allocator, HostExperts, pinned_empty
from moesub.engine.kernels import choose_path, expert_forward
from moesub.engine.store import aligned_empty, aligned_zeros
from moesub.engine.tiers import (
    BackgroundReader,
    HostSync,
    SlotBuffers,
    host_ids_to_local,
    layer_capacities,
    read_experts,
    require_cuda,
)

STAGING_BYTES = 512 * 2**20  # GPU memory for admission staging buffers by default
BOUNCE_BUFFERS = 8  # pinned buffers for synchronous fetches of layers on disk
READ_BUFFERS = 16  # pinned buffers the I/O thread reads admissions of layers on disk into


def default_staging_buffers(capacities: Sequence[int], expert_bytes: int) -> int:
    """Enough GPU staging buffers that admissions do not queue behind each other: one per slot
    of every layer, at most STAGING_BYTES of them (and at least 4)."""
    return max(4, min(sum(capacities), STAGING_BYTES // max(expert_bytes, 1)))


class CudaTier:
    """Experts in host memory (`HostExperts`), C_l slots for layer l on the GPU
    (`layer_capacities`)."""

    def __init__(
        self,
        host: HostExperts,
        capacity: int | Sequence[int],
        device: str | torch.device,
        act: Callable[[torch.Tensor], torch.Tensor],
        staging_buffers: int | None = None,
        capability: tuple[int, int] | None = None,
        alloc: Allocator = pinned_empty,
        cuda=None,
        top_k: int | None = None,
    ) -> None:
        # `cuda`: the torch.cuda API the tier drives (streams, events, synchronize); a test
        # passes a CPU stand-in to run the tier's bookkeeping without a GPU
        self.cuda = torch.cuda if cuda is None else cuda
        if cuda is None:
            dev = require_cuda(device)
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device(device)
        lay = host.layout
        caps = layer_capacities(capacity, lay.num_layers)
        n = staging_buffers or default_staging_buffers(caps, lay.expert_bytes)
        if n < 1:
            raise ValueError(f"staging_buffers must be >= 1, got {n}")
        self.device, self.act, self.host, self.layout, self.alloc = dev, act, host, lay, alloc
        self.expert_bytes = lay.expert_bytes
        self.kind = "disk->pinned->CUDA" if host.disk_layers else "pinned->CUDA"
        # experts on disk: the host's fresh reads and the copies both come from the disk
        self.host_reads_link = bool(host.disk_layers)
        self.path = choose_path(dev, lay.torch_dtype, capability)
        self.syncs = HostSync()
        dt = lay.torch_dtype
        self.compute = self.cuda.current_stream(dev)
        self.side = self.cuda.Stream(device=dev)
        self.slots = [
            SlotBuffers(
                torch.empty((C, *lay.gate_up_shape), dtype=dt, device=dev),
                torch.empty((C, *lay.down_shape), dtype=dt, device=dev),
            )
            for C in caps
        ]
        self.staging = [
            (
                torch.empty(lay.gate_up_shape, dtype=dt, device=dev),
                torch.empty(lay.down_shape, dtype=dt, device=dev),
            )
            for _ in range(n)
        ]
        self._staging_fence: list[torch.cuda.Event | None] = [None] * n  # install out of it
        self._free = list(range(n))
        # admissions waiting for a staging buffer: (layer, expert, pinned read buffer or None)
        self._queued: collections.deque[tuple[int, int, int | None]] = collections.deque()
        self._inflight = [collections.deque() for _ in range(lay.num_layers)]
        self.reader = None
        self._bounce: list[tuple[torch.Tensor, torch.Tensor]] = []
        if host.disk_layers:
            self.reader = BackgroundReader(host.store, min(n, READ_BUFFERS), alloc)
            self._bounce = [
                (alloc(lay.gate_up_shape, dt), alloc(lay.down_shape, dt))
                for _ in range(BOUNCE_BUFFERS)
            ]
        self._bounce_fence: list[torch.cuda.Event | None] = [None] * len(self._bounce)
        self._bounce_next = 0
        self._io: dict[tuple, torch.Tensor] = {}  # per-layer pinned transfer buffers
        self._fetch_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._wait_s = 0.0  # host time on disk reads of synchronous fetches
        # the host's fresh reads of layers on disk (`host_forward`), up to `top_k` experts a step,
        # written here (`aligned_zeros`), as the disk tier's; grown in a step that needs more
        self._host_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        if host.disk_layers and top_k:
            self._hold_host_scratch(top_k)

    @property
    def description(self) -> str:
        return (
            f"{self.kind}: {self.host.describe()}; C_l slots per layer l on {self.device} "
            f"({self.cuda.get_device_name(self.device)}), admissions on a side CUDA stream "
            f"({len(self.staging)} staging buffers), expert kernel {self.path}; host_compute "
            "misses computed on the CPU from the host weights"
        )

    # ---------------------------------------------------------------- host <-> device transfers
    def _pinned(self, key: tuple, shape: torch.Size | tuple[int, ...], dtype) -> torch.Tensor:
        """A pinned buffer for `key`, grown (never shrunk) to `shape`'s size; a view of it."""
        numel = int(np.prod(shape))
        buf = self._io.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor: reusable in and out of it
                buf = self.alloc((numel,), dtype)
            self._io[key] = buf
        return buf[:numel].view(shape)

    def to_host(self, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device tensors of one layer copied into its pinned buffers; one event, one wait."""
        with self.cuda.stream(self.compute):
            out = []
            for i, t in enumerate(tensors):
                buf = self._pinned(("d2h", layer, i), t.shape, t.dtype)
                buf.copy_(t.detach(), non_blocking=True)
                out.append(buf)
            ev = self.cuda.Event()
            ev.record(self.compute)
        self.syncs.wait(ev)
        return tuple(out)

    def upload(self, layer: int, array: np.ndarray, tag: str = "ids") -> torch.Tensor:
        """A host array on the device through the layer's pinned buffer `tag` (no wait)."""
        src = torch.from_numpy(np.ascontiguousarray(array))
        buf = self._pinned(("h2d", layer, tag), src.shape, src.dtype)
        buf.copy_(src)
        with self.cuda.stream(self.compute):
            return buf.to(self.device, non_blocking=True)

    # ---------------------------------------------------------------- slots
    def load(self, layer: int, resident: np.ndarray) -> None:
        """Fill the slots with `resident` (C,) experts (-1 = leave empty); untimed set-up."""
        s = self.slots[layer]
        lay = self.layout
        tmp = (aligned_empty(lay.gate_up_shape, lay.torch_dtype),
               aligned_empty(lay.down_shape, lay.torch_dtype))  # fmt: skip
        with self.cuda.stream(self.compute):
            for slot, e in enumerate(resident.tolist()):
                if e < 0:
                    continue
                if self.host.on_disk(layer):
                    self.host.read_into(layer, e, *tmp)
                    s.gate_up[slot].copy_(tmp[0])  # pageable source: synchronous
                    s.down[slot].copy_(tmp[1])
                else:
                    gu, dn = self.host.layer(layer)
                    s.gate_up[slot].copy_(gu[e], non_blocking=True)
                    s.down[slot].copy_(dn[e], non_blocking=True)
        self.synchronize()

    def _bounce_buffer(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The next pinned bounce buffer, once the copy out of its last use has run."""
        b = self._bounce_next
        self._bounce_next = (b + 1) % len(self._bounce)
        fence = self._bounce_fence[b]
        if fence is not None and not fence.query():
            self.syncs.wait(fence)
        return (*self._bounce[b], b)

    def fetch(self, layer: int, pairs: Sequence[tuple[int, int]]) -> int:
        """Synchronous copies (expert, slot) on the compute stream: the next kernels wait for
        them, the host does not (except for the disk read of a layer on disk)."""
        if not pairs:
            return 0
        s = self.slots[layer]
        start, end = self.cuda.Event(enable_timing=True), self.cuda.Event(enable_timing=True)
        with self.cuda.stream(self.compute):
            start.record(self.compute)
            if self.host.on_disk(layer):
                for e, slot in pairs:
                    gu, dn, b = self._bounce_buffer()
                    t0 = time.perf_counter()
                    self.host.store.read_into(layer, e, gu, dn)
                    self._wait_s += time.perf_counter() - t0
                    s.gate_up[slot].copy_(gu, non_blocking=True)
                    s.down[slot].copy_(dn, non_blocking=True)
                    fence = self.cuda.Event()
                    fence.record(self.compute)
                    self._bounce_fence[b] = fence
            else:
                gu, dn = self.host.layer(layer)
                for e, slot in pairs:
                    s.gate_up[slot].copy_(gu[e], non_blocking=True)
                    s.down[slot].copy_(dn[e], non_blocking=True)
            end.record(self.compute)
        self._fetch_events.append((start, end))
        return len(pairs) * self.expert_bytes

    # ---------------------------------------------------------------- background admissions
    def request(self, layer: int, expert: int) -> None:
        if self.host.on_disk(layer):
            self.reader.submit(layer, expert)  # disk -> pinned first, on the I/O thread
        else:
            self._queued.append((layer, expert, None))
            self._launch_queued()

    def _launch_queued(self) -> None:
        while self._queued and self._free:
            layer, expert, read_buf = self._queued.popleft()
            self._launch(layer, expert, read_buf, self._free.pop())

    def _launch(self, layer: int, expert: int, read_buf: int | None, idx: int) -> None:
        if read_buf is None:
            gu, dn = self.host.layer(layer)
            src = (gu[expert], dn[expert])
        else:
            src = self.reader.buffers[read_buf]
        sg, sd = self.staging[idx]
        with self.cuda.stream(self.side):
            fence = self._staging_fence[idx]
            if fence is not None:
                self.side.wait_event(fence)  # the last install out of this buffer has run
            sg.copy_(src[0], non_blocking=True)
            sd.copy_(src[1], non_blocking=True)
            done = self.cuda.Event()
            done.record(self.side)
        if read_buf is not None:
            self.reader.release(read_buf, fence=done)  # reused once this copy has run
        self._inflight[layer].append((expert, idx, done))

    def _pump(self, layers: Sequence[int]) -> None:
        """Disk reads that have landed in pinned memory go on to the GPU (side stream)."""
        if self.reader is not None:
            for layer in layers:
                if self.host.on_disk(layer):
                    for expert, read_buf, _n in self.reader.poll(layer):
                        self._queued.append((layer, expert, read_buf))
        self._launch_queued()

    def begin_token(self) -> None:
        self._pump(range(self.layout.num_layers))

    def completed(self, layer: int) -> list[tuple[int, int, int]]:
        """(expert, staging buffer, bytes) of every admission of `layer` whose copy has run."""
        self._pump([layer])
        out = []
        q = self._inflight[layer]
        while q and q[0][2].query():
            expert, idx, _ = q.popleft()
            out.append((expert, idx, self.expert_bytes))
        return out

    def _release(self, idx: int, fence: torch.cuda.Event | None) -> None:
        self._staging_fence[idx] = fence
        self._free.append(idx)
        self._launch_queued()

    def install(self, layer: int, handle: tuple[int, int, int], slot: int) -> int:
        _e, idx, nbytes = handle
        sg, sd = self.staging[idx]
        s = self.slots[layer]
        with self.cuda.stream(self.compute):
            s.gate_up[slot].copy_(sg, non_blocking=True)
            s.down[slot].copy_(sd, non_blocking=True)
            fence = self.cuda.Event()
            fence.record(self.compute)
        self._release(idx, fence)
        return nbytes

    def discard(self, handle: tuple[int, int, int]) -> None:
        self._release(handle[1], None)

    # ---------------------------------------------------------------- host compute, time
    def host_forward(
        self, layer: int, hidden: torch.Tensor, host_ids: np.ndarray, weights: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Misses computed on the CPU from the host weights (pinned: no copy; on disk: a fresh
        read); hidden [N, H] and weights [N, k] already on the host (`to_host`). The weighted
        rows [N, k, H] (`expert_forward(per_rank=True)`) go back through the layer's pinned
        buffer without a wait. -> (rows on the GPU, bytes)."""
        nbytes = 0
        if self.host.on_disk(layer):
            ids, experts = host_ids_to_local(host_ids)
            gu, dn = (t[: len(experts)] for t in self._hold_host_scratch(len(experts)))
            for j, e in enumerate(experts.tolist()):
                nbytes += self.host.store.read_into(layer, e, gu[j], dn[j])
        else:
            ids = host_ids
            gu, dn = self.host.layer(layer)
        out = expert_forward(hidden, ids, weights, gu, dn, self.act, per_rank=True)
        buf = self._pinned(("host_out", layer), out.shape, out.dtype)
        buf.copy_(out)
        with self.cuda.stream(self.compute):
            return buf.to(self.device, non_blocking=True), nbytes

    def _hold_host_scratch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The host's scratch, grown to hold at least `n` experts (its pages written)."""
        if self._host_scratch is None or len(self._host_scratch[0]) < n:
            lay = self.layout
            shapes = ((n, *lay.gate_up_shape), (n, *lay.down_shape))
            self._host_scratch = tuple(aligned_zeros(s, lay.torch_dtype) for s in shapes)
        return self._host_scratch

    def read_range(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts first..first+count-1 of a layer on the host (a prompt's prefill): views of
        the pinned layer, or one sequential read of a layer on disk."""
        if self.host.on_disk(layer):
            return read_experts(self.host.store, layer, first, count)
        gu, dn = self.host.layer(layer)
        return gu[first : first + count], dn[first : first + count]

    def host_begin(
        self,
        layer: int,
        hidden: torch.Tensor,
        host_ids: np.ndarray,
        weights: torch.Tensor,
        then: Sequence[int] = (),
    ) -> tuple:
        """The host's experts start at `host_end`: the slot kernels queued between the two run
        on the GPU while the CPU computes (the host thread is the one the GPU does not need).
        The copies of experts `then` (its uploads) start after them."""
        return (layer, hidden, host_ids, weights, tuple(then))

    def host_end(self, job: tuple) -> tuple[torch.Tensor, int]:
        """`host_forward` of `host_begin`'s inputs: (rows [N, k, H] on the GPU, bytes read);
        then the copies of `then` start (behind the host's own reads where its layer is on
        disk: the engine holds uploads only on a tier whose host reads over the link)."""
        layer, hidden, host_ids, weights, then = job
        rows = self.host_forward(layer, hidden, host_ids, weights)
        for expert in then:
            self.request(layer, expert)
        return rows

    def token_sync(self) -> None:
        """Wait for the compute stream (not the side stream: admissions keep copying)."""
        ev = self.cuda.Event()
        ev.record(self.compute)
        self.syncs.wait(ev)

    def take_wait_s(self) -> float:
        """Seconds the compute stream spent on synchronous copies (and the host on disk reads
        for them) since the last call; the copies' events have completed (after `token_sync`)."""
        w = sum(a.elapsed_time(b) for a, b in self._fetch_events) / 1e3 + self._wait_s
        self._fetch_events.clear()
        self._wait_s = 0.0
        return w

    def synchronize(self) -> None:
        """The whole device (set-up, stream boundaries and calibration only)."""
        self.cuda.synchronize(self.device)

    def drain(self) -> None:
        """Discard every queued and in-flight admission (stream boundary)."""
        for _layer, _expert, read_buf in self._queued:
            if read_buf is not None:
                self.reader.release(read_buf)
        self._queued.clear()
        if self.reader is not None:
            self.reader.drain()
        self.synchronize()
        for q in self._inflight:
            while q:
                _e, idx, _ev = q.popleft()
                self._staging_fence[idx] = None
                self._free.append(idx)

    def close(self) -> None:
        self.drain()
        if self.reader is not None:
            self.reader.close()
