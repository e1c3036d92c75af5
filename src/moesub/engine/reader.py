"""The I/O thread of a tier's background copies: requested experts read from the store into
staging buffers (`BackgroundReader`), which the tier installs into slots once they have landed
(the disk tier, `moesub.engine.tiers.DiskTier`; the CUDA tier's layers on disk,
`moesub.engine.cuda_tier.CudaTier`, read into pinned buffers and copied to the GPU from there).
An expert already in memory (the host's read of an expert it uploads) is copied into a free
buffer instead (`deliver`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import torch

from moesub.engine.copies import COPY_TIMEOUT_S
from moesub.engine.host_memory import Allocator
from moesub.engine.store import ExpertStore, aligned_zeros


class BackgroundReader:
    """An I/O thread that reads requested experts from the store into staging buffers.

    `submit(layer, expert)` enqueues a read; `poll(layer)` returns `(expert, buffer)` for every
    read of that layer that has completed; the caller installs the buffer and `release`s it.
    Reads wait for a free staging buffer, so at most `num_buffers` admissions are in flight.
    Buffers come from `alloc` (pinned memory on the CUDA tier); a buffer released with a
    `fence` (a CUDA event: the copy out of it) is reused only once the fence has completed.
    """

    def __init__(
        self, store: ExpertStore, num_buffers: int, alloc: Allocator = aligned_zeros
    ) -> None:
        if num_buffers < 1:
            raise ValueError(f"staging_buffers must be >= 1, got {num_buffers}")
        lay = store.layout
        self.store = store
        self.buffers = [
            (alloc(lay.gate_up_shape, lay.torch_dtype), alloc(lay.down_shape, lay.torch_dtype))
            for _ in range(num_buffers)
        ]
        self._fence: list[torch.cuda.Event | None] = [None] * num_buffers
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
                fence, self._fence[idx] = self._fence[idx], None
                if fence is not None:  # the device copy out of this buffer must have run
                    fence.synchronize()  # (on the I/O thread: the compute thread never waits)
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

    def deliver(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        """An expert already in memory (the host's read of it) copied into a free staging buffer
        and reported complete as if read: no read. False where no buffer is free (the caller
        reads it instead: waiting here could wait on a buffer only the caller gives back)."""
        try:
            idx = self._free.get_nowait()
        except queue.Empty:
            return False
        fence, self._fence[idx] = self._fence[idx], None
        if fence is not None:
            fence.synchronize()
        gu, dn = self.buffers[idx]
        gu.copy_(gate_up)
        dn.copy_(down)
        self._done[layer].append((expert, idx, gu.nbytes + dn.nbytes))
        return True

    def poll(self, layer: int) -> list[tuple[int, int, int]]:
        """(expert, buffer index, bytes) of every completed read of `layer`."""
        if self._error is not None:
            raise RuntimeError(f"background expert read failed: {self._error}") from self._error
        done = self._done[layer]
        out = []
        while done:
            out.append(done.popleft())
        return out

    def release(self, idx: int, fence: torch.cuda.Event | None = None) -> None:
        self._fence[idx] = fence
        self._free.put(idx)

    def drain(self, stall_s: float = COPY_TIMEOUT_S) -> None:
        """Wait for every submitted read, then discard the results (stream boundary). A read
        waiting for a buffer the caller holds (a landed copy not given back: close the engine,
        not its tier) would wait forever: `stall_s` without a read done raises instead."""
        left, since = self._requests.unfinished_tasks, time.perf_counter()
        while self._requests.unfinished_tasks:
            # reads block on a free buffer: keep releasing finished ones while waiting
            for layer in range(len(self._done)):
                for _e, idx, _n in self.poll(layer):
                    self.release(idx)
            if self._requests.unfinished_tasks < left:
                left, since = self._requests.unfinished_tasks, time.perf_counter()
            elif time.perf_counter() - since > stall_s:
                raise RuntimeError(
                    f"drain: {left} expert reads wait for a staging buffer that the caller "
                    f"holds ({len(self.buffers)} buffers, {self._free.qsize()} free): give the "
                    "landed copies back first (OffloadEngine.close, not the tier's close)"
                )
            time.sleep(0.0005)
        for layer in range(len(self._done)):
            for _e, idx, _n in self.poll(layer):
                self.release(idx)

    def close(self) -> None:
        if self._thread.is_alive():
            self.drain()
            self._requests.put(None)
            self._thread.join(timeout=30)


DISK_STAGING_BUFFERS = 4  # the I/O thread reads one expert at a time: a few buffers suffice
