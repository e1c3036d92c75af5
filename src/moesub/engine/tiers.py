"""Fast-tier expert slots and the disk tier (the CUDA tier is `moesub.engine.cuda_tier`).

A tier owns, per MoE layer `l`, `C_l` preallocated expert slots in fast memory (`SlotBuffers`;
the capacity is one int for every layer or one per layer, `layer_capacities`) and the way
experts reach them from the slow tier. Every tier has the same interface, which
`OffloadEngine` drives: `load`, `fetch`, `request` / `completed` / `install` / `discard`
(background copies: admissions and prefetches), `begin_token`, `to_host` / `upload` (the
router's values to the host, index arrays to the device), `host_begin` / `host_end` (the host's
experts, concurrently with the fast tier's), `token_sync`, `take_wait_s`,
`synchronize`, `drain`, `close`, plus `slots`, `device`, `act`, `path` (the expert kernel,
`moesub.engine.kernels`), `syncs` (`HostSync`), `kind`, `description`.

`DiskTier` (CPU-only machines): the slow tier is an `ExpertStore` file, the fast tier RAM.
Synchronous fetches are blocking uncached reads straight into the slot; background admissions
(and the uploads of host-computed experts, `host_admit`: the I/O thread reads the expert again
rather than keeping the host worker's read) are read by an I/O thread into staging buffers, and
installed into the slot the policy core names once the read has really completed. The host's
experts (host_compute, light_miss="host") are read by a worker thread, each fresh from disk
("host weights" live there), while the main thread computes the slots' experts, which then
computes the host's: the tier has one processor, and a worker computing beside the main thread
put two OpenMP teams on the cores, whose runs were bimodal on a 2-core machine, 25-45% apart
(docs/measurements.md). Loading the slots (untimed) copies the experts a `SlotImage` holds
rather than reading them again: the engine benchmark's runs each start from the same initial set.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from moesub.engine.copies import COPY_TIMEOUT_S
from moesub.engine.host_memory import Allocator
from moesub.engine.kernels import choose_path, expert_forward
from moesub.engine.store import ExpertStore, StoreLayout, aligned_empty, aligned_zeros
from moesub.run_speed import DiskClock


@dataclass
class SlotBuffers:
    """One layer's C expert slots in fast memory."""

    gate_up: torch.Tensor  # (C, 2I, H)
    down: torch.Tensor  # (C, H, I)

    @property
    def capacity(self) -> int:
        return self.gate_up.shape[0]


@dataclass
class SlotImage:
    """Some experts of each layer read once into RAM: per layer their `ids` (n,) and their
    weights in `SlotBuffers` order. A disk tier given one copies these experts from it when it
    loads its slots, instead of reading them from the disk again (the engine benchmark's runs
    each load the same initial set: untimed, but 2-3 s a run from this VM's disk)."""

    ids: list[np.ndarray]
    slots: list[SlotBuffers]

    @staticmethod
    def read(store: ExpertStore, ids: Sequence[np.ndarray]) -> SlotImage:
        """Layer l's experts `ids[l]` read from `store` (not on its read clock)."""
        lay, slots = store.layout, []
        for layer, layer_ids in enumerate(ids):
            n, dt = len(layer_ids), lay.torch_dtype
            s = SlotBuffers(aligned_empty((n, *lay.gate_up_shape), dt),
                            aligned_empty((n, *lay.down_shape), dt))  # fmt: skip
            for i, e in enumerate(np.asarray(layer_ids).tolist()):
                store.read_into(layer, e, s.gate_up[i], s.down[i], clocked=False)
            slots.append(s)
        return SlotImage([np.asarray(i) for i in ids], slots)


def disk_clock(tier) -> DiskClock:
    """What the disk tier's expert file has read so far (`ExpertStore.read_clock`): the
    difference of two is what a run read. Nothing for the CUDA tier: its copies come from
    pinned memory, or only some from disk, so its file's reads do not time its copies."""
    if isinstance(tier, DiskTier):
        return DiskClock(*tier.store.read_clock())
    return DiskClock(0, 0.0)


def layer_capacities(capacity: int | Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Slots per layer: `capacity` an int (every layer) or a sequence of `num_layers` ints."""
    if isinstance(capacity, Sequence) or getattr(capacity, "ndim", 0) == 1:
        caps = tuple(int(c) for c in capacity)
        if len(caps) != num_layers:
            raise ValueError(f"capacity: {len(caps)} per-layer slot counts for {num_layers} layers")
    else:
        caps = (int(capacity),) * num_layers
    if min(caps) < 1:
        raise ValueError(f"capacity: every layer needs at least one slot, got {list(caps)}")
    return caps


def host_ids_to_local(host_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """host_ids (N, k) expert or -1 -> (local index (N, k) or -1, experts (n,) in local order)."""
    flat = host_ids.reshape(-1)
    experts, inverse = np.unique(flat[flat >= 0], return_inverse=True)
    local = np.full(flat.shape, -1, dtype=np.int64)
    local[flat >= 0] = inverse
    return local.reshape(host_ids.shape), experts


RUN_GAP_BYTES = 2**20  # experts this close in the file are read in one sequential read
RUN_BYTES = 256 * 2**20  # at most this much per read
# experts this large are loaded one read each, straight into their slots: a read's latency is a
# small part of its transfer, and a sequential run goes through a bounce buffer and a copy (the
# benchmark's 6 MiB experts, 2 layers: 1.4 s against 2.6 s for 128 slots each, 6.5 s against
# 17.5 s for all 512; 2026-12-03)
LOAD_ALONE_BYTES = 2**20


def expert_runs(experts: np.ndarray, stride: int) -> list[tuple[int, list[int]]]:
    """Sorted expert ids -> runs `(first id, ids)` to read together: a gap of more than
    RUN_GAP_BYTES (unused experts read for nothing) or a run past RUN_BYTES starts a new one."""
    runs: list[tuple[int, list[int]]] = []
    for e in np.asarray(experts).tolist():
        if runs:
            lo, ids = runs[-1]
            if (e - ids[-1] - 1) * stride <= RUN_GAP_BYTES and (e - lo + 1) * stride <= RUN_BYTES:
                ids.append(e)
                continue
        runs.append((e, [e]))
    return runs


def read_experts(
    store: ExpertStore, layer: int, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts first..first+count-1 of a layer in one sequential uncached read (a prompt's
    prefill: much faster than one read per expert): `(gate_up (count, 2I, H), down (count, H,
    I))`, views of one buffer (each expert is its gate_up then its down, `expert_stride` apart)."""
    lay = store.layout
    raw = aligned_empty((count * lay.expert_stride,), torch.uint8)
    store.read_raw(lay.offset(layer, first), count * lay.expert_stride, raw)
    rows = raw.view(count, lay.expert_stride)
    gate_up = rows[:, : lay.gate_up_bytes].view(lay.torch_dtype).view(count, *lay.gate_up_shape)
    down = rows[:, lay.gate_up_bytes : lay.expert_bytes].view(lay.torch_dtype)
    return gate_up, down.view(count, *lay.down_shape)


class HostSync:
    """Counts the points where the host waits for the device; the engine reports them per token
    (`TokenStats.syncs`). Every such wait in the tiers goes through `wait`. On the disk tier
    there is no device: the count is of the points where the GPU engine waits."""

    def __init__(self) -> None:
        self.count = 0

    def wait(self, event: torch.cuda.Event | None = None) -> None:
        self.count += 1
        if event is not None:
            event.synchronize()


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


# ------------------------------------------------------------------------------------ disk tier


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


class HostJob(NamedTuple):
    """The disk tier's host experts of one step: their reads in flight, the inputs kept."""

    read: Future  # -> `DiskTier.host_read`'s (scratch ids, experts, bytes)
    hidden: torch.Tensor  # [N, H]
    weights: torch.Tensor  # [N, k]


class DiskTier:
    """Experts on disk (`ExpertStore`), C_l slots in RAM for layer l (`layer_capacities`)."""

    kind = "disk->RAM"
    # the host computes each expert from a fresh disk read: over the link the copies use
    host_reads_link = True

    def __init__(
        self,
        store: ExpertStore,
        capacity: int | Sequence[int],
        k: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        staging_buffers: int | None = None,
        image: SlotImage | None = None,
        slots: list[SlotBuffers] | None = None,
    ) -> None:
        lay: StoreLayout = store.layout
        self.store, self.layout, self.act, self.image = store, lay, act, image
        self.device = torch.device("cpu")
        dt = lay.torch_dtype
        caps = layer_capacities(capacity, lay.num_layers)
        # `slots`: an earlier tier's buffers of these capacities, whose pages are already backed
        # (the engine bench's runs each get a fresh tier, not fresh memory: `aligned_zeros`)
        if slots is not None and [s.capacity for s in slots] != list(caps):
            raise ValueError(f"slots hold {[s.capacity for s in slots]} experts, not {caps}")
        self.slots = slots or [
            SlotBuffers(
                aligned_empty((C, *lay.gate_up_shape), dt), aligned_empty((C, *lay.down_shape), dt)
            )
            for C in caps
        ]
        # scratch for host_compute misses: up to k experts of one token, read fresh every time
        # (its pages written here, not by a token's first read into them: `aligned_zeros`)
        self._host_gu = aligned_zeros((k, *lay.gate_up_shape), dt)
        self._host_dn = aligned_zeros((k, *lay.down_shape), dt)
        self.reader = BackgroundReader(store, staging_buffers or DISK_STAGING_BUFFERS)
        self.path = choose_path(self.device, dt)
        self.syncs = HostSync()
        self._wait_s = 0.0
        # the host's experts of one layer at a time (they use the scratch buffers above)
        self._host = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moesub-host")

    @property
    def description(self) -> str:
        return (
            f"disk->RAM: experts read from {self.store.path.name} with {self.store.mode} "
            "(page cache bypassed); host_compute misses computed on the CPU from a fresh "
            "uncached disk read per miss"
        )

    def load(self, layer: int, resident: np.ndarray) -> None:
        """Fill the slots with `resident` (C,) experts (-1 = leave empty); not timed (nor on the
        store's read clock). Experts the tier's `image` holds are copied from it; of the rest,
        small experts close together in the file are read together (`expert_runs`), large ones
        alone (`LOAD_ALONE_BYTES`)."""
        s = self.slots[layer]
        slot_of = {e: slot for slot, e in enumerate(resident.tolist()) if e >= 0}
        for slot in np.flatnonzero(resident < 0).tolist():  # an empty slot's pages written
            s.gate_up[slot].zero_()  # now, untimed, not by the fetch into it (`aligned_zeros`)
            s.down[slot].zero_()
        if self.image is not None:
            held = self.image.slots[layer]
            for i, e in enumerate(self.image.ids[layer].tolist()):
                if (slot := slot_of.pop(e, None)) is not None:
                    s.gate_up[slot].copy_(held.gate_up[i])
                    s.down[slot].copy_(held.down[i])
        if self.layout.expert_bytes >= LOAD_ALONE_BYTES:
            for e, slot in slot_of.items():
                self.store.read_into(layer, e, s.gate_up[slot], s.down[slot], clocked=False)
            return
        for lo, run in expert_runs(np.array(sorted(slot_of)), self.layout.expert_stride):
            gu, dn = read_experts(self.store, layer, lo, run[-1] - lo + 1)
            for e in run:
                s.gate_up[slot_of[e]].copy_(gu[e - lo])
                s.down[slot_of[e]].copy_(dn[e - lo])

    def fetch(self, layer: int, pairs: Sequence[tuple[int, int]]) -> int:
        """Synchronously copy experts into slots: pairs of (expert, slot). Returns bytes."""
        s = self.slots[layer]
        n = 0
        t0 = time.perf_counter()
        for e, slot in pairs:
            n += self.store.read_into(layer, e, s.gate_up[slot], s.down[slot])
        self._wait_s += time.perf_counter() - t0
        return n

    def begin_token(self) -> None:
        pass

    def to_host(self, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The router's values on the host: already there (counted where a GPU would wait)."""
        self.syncs.wait()
        return tuple(t.detach() for t in tensors)

    def upload(self, layer: int, array: np.ndarray, tag: str = "ids") -> torch.Tensor:
        """A host array as a tensor of the fast tier (here the host itself)."""
        return torch.from_numpy(np.ascontiguousarray(array))

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

    def host_read(self, layer: int, host_ids: np.ndarray) -> tuple[np.ndarray, int, int]:
        """A step's host experts read fresh from disk (uncached) into the scratch slots: host_ids
        (N, k) expert or -1 -> (scratch ids (N, k), -1 where none; experts read; bytes read)."""
        local, experts = host_ids_to_local(host_ids)
        n = 0
        for j, e in enumerate(experts.tolist()):
            n += self.store.read_into(layer, e, self._host_gu[j], self._host_dn[j])
        return local, len(experts), n

    def read_range(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts first..first+count-1 of a layer on the host (a prompt's prefill)."""
        return read_experts(self.store, layer, first, count)

    def host_begin(
        self,
        layer: int,
        hidden: torch.Tensor,
        host_ids: np.ndarray,
        weights: torch.Tensor,
        then: Sequence[int] = (),
    ) -> HostJob:
        """Start the host's reads on the worker thread, then the background copies of experts
        `then` (its uploads: behind its reads on the one disk); the caller computes the slots'
        experts meanwhile and the host's after them (`host_end`): one processor, one OpenMP
        team."""
        return HostJob(
            self._host.submit(self._read_then_request, layer, host_ids, tuple(then)),
            hidden, weights,
        )  # fmt: skip

    def _read_then_request(
        self, layer: int, host_ids: np.ndarray, then: tuple[int, ...]
    ) -> tuple[np.ndarray, int, int]:
        read = self.host_read(layer, host_ids)
        for expert in then:
            self.reader.submit(layer, expert)
        return read

    def host_end(self, job: HostJob) -> tuple[torch.Tensor, int]:
        """The host's experts, once read: hidden [N, H] and weights [N, k] -> (weighted rows
        [N, k, H], zero where the step had no host expert, `expert_forward(per_rank=True)`;
        bytes read)."""
        local, m, nbytes = job.read.result()
        out = expert_forward(
            job.hidden, local, job.weights, self._host_gu[:m], self._host_dn[:m], self.act,
            per_rank=True,
        )  # fmt: skip
        return out, nbytes

    def token_sync(self) -> None:
        """End of a token: the compute is done (CPU compute is synchronous; counted)."""
        self.syncs.wait()

    def take_wait_s(self) -> float:
        w, self._wait_s = self._wait_s, 0.0
        return w

    def synchronize(self) -> None:
        pass

    def drain(self) -> None:
        self.reader.drain()

    def close(self) -> None:
        self.reader.close()
        self._host.shutdown(wait=True)
