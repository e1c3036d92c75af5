"""The CUDA tier: experts in pinned host memory, C slots per layer on the GPU.

Synchronous fetches are host->device copies on the compute stream (blocked time measured with
CUDA events); admissions are copied on a side stream into GPU staging buffers and installed
(device->device) once their event has completed. host_compute misses are computed on the CPU
from the pinned host weights.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import numpy as np
import torch

from moesub.engine.kernels import grouped_experts
from moesub.engine.store import ExpertStore
from moesub.engine.tiers import SlotBuffers, require_cuda


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
