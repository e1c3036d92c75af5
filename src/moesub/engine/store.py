"""The slow tier of the CPU-only engine: every routed expert of every MoE layer in one file.

Layout (little-endian, written once, atomically): a 4096-byte header (magic + JSON layout), then
for MoE layer `l` and expert `e` in (l, e) order one record at
`HEADER_BYTES + (l * E + e) * expert_stride`: the expert's fused `gate_up [2I, H]` bytes, then
its `down [H, I]` bytes (the engine's expert layout, `moesub.models.MoEFamily.expert_weights`),
zero-padded to a multiple of `ALIGN` (4096) bytes.

Reads must cost what a device read costs, so the page cache is kept out of the way: with
`O_DIRECT` (when both halves of an expert are multiples of 4096 bytes and the destination is
4096-byte aligned, as for every real-size expert) the read goes straight from the device into
the destination buffer; otherwise a buffered read is followed by
`posix_fadvise(POSIX_FADV_DONTNEED)` on that range, and the whole file is dropped from the page
cache when it is opened. Readahead is disabled (`POSIX_FADV_RANDOM`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from moesub.io import atomic_path
from moesub.params import DTYPE_NAMES

MAGIC = b"MOESUBEX1\n"
HEADER_BYTES = 4096
ALIGN = 4096
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class StoreLayout:
    """Shape of an expert store: L MoE layers x E experts of `gate_up [2I, H]` + `down [H, I]`."""

    num_layers: int
    num_experts: int
    hidden: int  # H
    width: int  # I (expert intermediate size)
    dtype: str  # a key of DTYPES
    fingerprint: str = ""  # identifies the weights' source (checkpoint digest or random seed)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "hidden", "width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"store layout: {name} must be a positive integer, got {v!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"store layout: dtype {self.dtype!r} not in {list(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def gate_up_shape(self) -> tuple[int, int]:
        return (2 * self.width, self.hidden)

    @property
    def down_shape(self) -> tuple[int, int]:
        return (self.hidden, self.width)

    @property
    def gate_up_bytes(self) -> int:
        return 2 * self.width * self.hidden * self.itemsize

    @property
    def down_bytes(self) -> int:
        return self.hidden * self.width * self.itemsize

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what a fetch moves)."""
        return self.gate_up_bytes + self.down_bytes

    @property
    def expert_stride(self) -> int:
        return round_up(self.expert_bytes)

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.num_layers * self.num_experts * self.expert_stride

    @property
    def direct_capable(self) -> bool:
        """True if O_DIRECT can read an expert straight into its two slot halves."""
        return self.gate_up_bytes % ALIGN == 0 and self.down_bytes % ALIGN == 0

    def offset(self, layer: int, expert: int) -> int:
        return HEADER_BYTES + (layer * self.num_experts + expert) * self.expert_stride

    def geometry(self) -> tuple[int, int, int, int, str]:
        return (self.num_layers, self.num_experts, self.hidden, self.width, self.dtype)


def tensor_fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A short digest of tensors' bytes (used to tell which checkpoint a store was written from)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (any dtype, bf16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, align: int = ALIGN) -> torch.Tensor:
    """An uninitialised CPU tensor whose first byte is `align`-byte aligned (for O_DIRECT)."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(n + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off : off + n].view(dtype).view(shape)


def aligned_zeros(shape: tuple[int, ...], dtype: torch.dtype, align: int = ALIGN) -> torch.Tensor:
    """`aligned_empty` with every page written once (zeros), for a buffer that timed reads go
    into. The kernel backs a fresh allocation's pages on their first write, and on this VM an
    uncached read into an untouched 6 MiB expert buffer took 20-48 ms instead of 3 in the engine
    bench (docs/measurements.md; `benchmarks/bench_fresh_buffers.py`): a runtime allocates its
    buffers once, at start, so the engine pays that where it sets up, not in a token's step."""
    return aligned_empty(shape, dtype, align).zero_()


# --------------------------------------------------------------------------------------- writing


def write_store(
    path: str | os.PathLike,
    layout: StoreLayout,
    experts: Iterable[tuple[torch.Tensor, torch.Tensor]],
    progress: bool = True,
) -> Path:
    """Write an expert store atomically. `experts` yields `(gate_up [2I, H], down [H, I])` for
    every (layer, expert) in (layer, expert) order, exactly `L * E` of them.

    The file is fsynced and then dropped from the page cache, so that the first read of every
    expert really comes from the device.
    """
    path = Path(path)
    header = MAGIC + json.dumps(asdict(layout)).encode() + b"\n"
    if len(header) > HEADER_BYTES:
        raise ValueError("store layout: header too long")
    pad = bytes(layout.expert_stride - layout.expert_bytes)
    total = layout.num_layers * layout.num_experts
    n = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(header.ljust(HEADER_BYTES, b"\0"))
        bar = tqdm(total=total, desc=f"write {path.name}", unit="expert", disable=not progress)
        for gate_up, down in experts:
            if n >= total:
                raise ValueError(f"experts: more than L*E = {total} experts given")
            if tuple(gate_up.shape) != layout.gate_up_shape or tuple(down.shape) != (
                layout.down_shape
            ):
                raise ValueError(
                    f"expert shape mismatch at (layer {n // layout.num_experts}, expert "
                    f"{n % layout.num_experts}): gate_up {tuple(gate_up.shape)}, down "
                    f"{tuple(down.shape)}; the store layout needs {layout.gate_up_shape} and "
                    f"{layout.down_shape}"
                )
            for t in (gate_up, down):
                t = t.detach().to(device="cpu", dtype=layout.torch_dtype).contiguous()
                f.write(byte_view(t))
            f.write(pad)
            n += 1
            bar.update(1)
        bar.close()
        if n != total:
            raise ValueError(f"experts: got {n} experts, the layout needs L*E = {total}")
        f.flush()
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def model_experts(
    blocks_weights: list[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(gate_up, down) per (layer, expert) from per-layer fused `[E, 2I, H]`, `[E, H, I]`."""
    for gate_up, down in blocks_weights:
        for e in range(gate_up.shape[0]):
            yield gate_up[e], down[e]


def random_experts(
    layout: StoreLayout, seed: int, scale: float | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded random experts of the layout's shape (N(0, 1/H) entries), one at a time."""
    g = torch.Generator().manual_seed(int(seed))
    s_up = scale if scale is not None else layout.hidden**-0.5
    s_dn = scale if scale is not None else layout.width**-0.5
    for _ in range(layout.num_layers * layout.num_experts):
        gu = torch.randn(layout.gate_up_shape, generator=g).mul_(s_up).to(layout.torch_dtype)
        dn = torch.randn(layout.down_shape, generator=g).mul_(s_dn).to(layout.torch_dtype)
        yield gu, dn


def read_layout(path: str | os.PathLike) -> StoreLayout:
    """The layout in a store's header; FileNotFoundError / ValueError for a missing or bad file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert store {str(path)!r} does not exist")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head.startswith(MAGIC) or len(head) < HEADER_BYTES:
        raise ValueError(f"expert store {str(path)!r}: not an expert store (bad header)")
    try:
        meta = json.loads(head[len(MAGIC) :].split(b"\n", 1)[0])
        return StoreLayout(**meta)
    except (ValueError, TypeError) as e:
        raise ValueError(f"expert store {str(path)!r}: unreadable header: {e}") from e


# --------------------------------------------------------------------------------------- reading


class ExpertStore:
    """Read access to an expert store, bypassing (or dropping) the page cache on every read.

    `expected` (optional) is the layout the caller needs; a store of another geometry or
    fingerprint raises ValueError. A file shorter or longer than its header says (truncated,
    or not finished) raises ValueError too. Reads are thread-safe (`pread`). `read_clock` counts
    `read_into`'s reads and the time at least one was in flight (reads of several threads at
    once count their overlap once): the disk's time per expert while a run read.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        expected: StoreLayout | None = None,
        direct: bool | None = None,
    ) -> None:
        self.path = Path(path)
        self.layout = read_layout(self.path)
        size = self.path.stat().st_size
        if size != self.layout.file_bytes:
            raise ValueError(
                f"expert store {str(self.path)!r} is truncated or corrupt: {size} bytes, its "
                f"header's layout needs {self.layout.file_bytes}"
            )
        if expected is not None:
            if expected.geometry() != self.layout.geometry():
                raise ValueError(
                    f"expert store {str(self.path)!r}: shape mismatch: the store holds "
                    f"(L, E, H, I, dtype) = {self.layout.geometry()}, the model needs "
                    f"{expected.geometry()}"
                )
            if expected.fingerprint and expected.fingerprint != self.layout.fingerprint:
                raise ValueError(
                    f"expert store {str(self.path)!r} was written from other weights "
                    f"(fingerprint {self.layout.fingerprint!r}, expected {expected.fingerprint!r})"
                )
        self._fd = os.open(self.path, os.O_RDONLY)
        self._dfd = -1
        want_direct = self.layout.direct_capable if direct is None else direct
        if want_direct and hasattr(os, "O_DIRECT"):
            try:
                self._dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # filesystem without O_DIRECT (tmpfs, some overlays)
                self._dfd = -1
        if direct and self._dfd < 0:
            raise ValueError(f"expert store {str(self.path)!r}: O_DIRECT is not available here")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.drop_cache()
        self._reads, self._busy_s, self._in_flight, self._busy_since = 0, 0.0, 0, 0.0
        self._clock_lock = threading.Lock()  # the tier's threads read concurrently

    @property
    def mode(self) -> str:
        """How reads avoid the page cache: 'O_DIRECT' or 'posix_fadvise(DONTNEED)'."""
        return "O_DIRECT" if self._dfd >= 0 else "posix_fadvise(DONTNEED)"

    def drop_cache(self) -> None:
        if hasattr(os, "posix_fadvise") and self._fd >= 0:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _check_index(self, layer: int, expert: int) -> None:
        if not (0 <= layer < self.layout.num_layers and 0 <= expert < self.layout.num_experts):
            raise IndexError(f"expert store: no (layer {layer}, expert {expert})")

    def read_into(
        self,
        layer: int,
        expert: int,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        clocked: bool = True,
    ) -> int:
        """Read one expert from the device into `gate_up [2I, H]` and `down [H, I]` (contiguous
        CPU tensors of the store's dtype, e.g. two slot views). Returns the bytes read.
        `clocked=False`: not counted by `read_clock` (an untimed load of the slots)."""
        self._check_index(layer, expert)
        lay = self.layout
        bufs = [byte_view(gate_up), byte_view(down)]
        if len(bufs[0]) != lay.gate_up_bytes or len(bufs[1]) != lay.down_bytes:
            raise ValueError("read_into: destination shapes/dtypes do not match the store")
        off = lay.offset(layer, expert)
        aligned = gate_up.data_ptr() % ALIGN == 0 and down.data_ptr() % ALIGN == 0
        if clocked:
            with self._clock_lock:
                if self._in_flight == 0:
                    self._busy_since = time.perf_counter()
                self._in_flight += 1
        try:
            if self._dfd >= 0 and aligned:
                _preadv_full(self._dfd, bufs, off)
            else:
                _preadv_full(self._fd, bufs, off)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self._fd, off, lay.expert_stride, os.POSIX_FADV_DONTNEED)
        finally:
            if clocked:
                with self._clock_lock:
                    self._in_flight -= 1
                    self._reads += 1
                    if self._in_flight == 0:
                        self._busy_s += time.perf_counter() - self._busy_since
        return lay.expert_bytes

    def read_clock(self) -> tuple[int, float]:
        """(experts read by `read_into`, seconds at least one of them was in flight) since the
        store opened; the difference of two is what happened between them."""
        with self._clock_lock:
            return self._reads, self._busy_s

    def read_expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh uncached read of one expert into new aligned tensors."""
        gu = aligned_empty(self.layout.gate_up_shape, self.layout.torch_dtype)
        dn = aligned_empty(self.layout.down_shape, self.layout.torch_dtype)
        self.read_into(layer, expert, gu, dn)
        return gu, dn

    def read_raw(self, offset: int, nbytes: int, buf: torch.Tensor) -> None:
        """Read `nbytes` (ALIGN multiple) at an ALIGN-multiple `offset` into an aligned uint8
        buffer, bypassing the cache (latency measurement)."""
        view = byte_view(buf)[:nbytes]
        fd = self._dfd if self._dfd >= 0 else self._fd
        _preadv_full(fd, [view], offset)
        if fd == self._fd and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in (self._fd, self._dfd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._dfd = -1

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _preadv_full(fd: int, bufs: list[memoryview], offset: int) -> None:
    want = sum(len(b) for b in bufs)
    got = os.preadv(fd, bufs, offset)
    while got < want:  # short read: continue where it stopped
        if got <= 0:
            raise OSError(f"expert store: unexpected end of file at offset {offset + got}")
        rest, skip = [], got
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(b[skip:])
            skip = 0
        bufs, offset, want = rest, offset + got, want - got
        got = os.preadv(fd, bufs, offset)


def open_or_write_store(
    path: str | os.PathLike,
    layout: StoreLayout,
    experts: Iterable[tuple[torch.Tensor, torch.Tensor]] | None,
    progress: bool = True,
) -> ExpertStore:
    """Open the store at `path` if it holds `layout` (geometry and fingerprint); otherwise write
    it from `experts` first (under an exclusive lock, so concurrent jobs write it once)."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = None
        if path.exists():
            try:
                ExpertStore(path, expected=layout).close()
            except (ValueError, OSError) as e:
                problem = str(e)
        if problem is not None or not path.exists():
            if experts is None:
                raise FileNotFoundError(
                    f"expert store {str(path)!r}: {problem or 'does not exist'}, and no source "
                    "to write it from was given"
                )
            if problem is not None:
                warnings.warn(f"{problem}; rewriting it", stacklevel=2)
            write_store(path, layout, experts, progress=progress)
    return ExpertStore(path, expected=layout)


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # expert-sized reads, page cache bypassed
    latency_s: float  # median time of one ALIGN-sized random read
    reads: int
    mode: str


def measure_read_bandwidth(store: ExpertStore, reads: int = 32, seed: int = 0) -> Bandwidth:
    """Time `reads` whole-expert reads of distinct random experts (cache dropped) and as many
    single-block reads at random offsets; returns bandwidth and per-read latency."""
    lay = store.layout
    rng = np.random.default_rng(seed)
    n_total = lay.num_layers * lay.num_experts
    picks = rng.choice(n_total, size=min(reads, n_total), replace=False)
    gu = aligned_zeros(lay.gate_up_shape, lay.torch_dtype)
    dn = aligned_zeros(lay.down_shape, lay.torch_dtype)
    store.drop_cache()
    t0 = time.perf_counter()
    for i in picks:
        store.read_into(int(i) // lay.num_experts, int(i) % lay.num_experts, gu, dn)
    elapsed = time.perf_counter() - t0
    small = aligned_zeros((ALIGN,), torch.uint8)
    blocks = (lay.file_bytes - HEADER_BYTES) // ALIGN
    lat = []
    for b in rng.choice(blocks, size=len(picks), replace=False):
        t = time.perf_counter()
        store.read_raw(HEADER_BYTES + int(b) * ALIGN, ALIGN, small)
        lat.append(time.perf_counter() - t)
    return Bandwidth(
        bytes_per_s=len(picks) * lay.expert_bytes / elapsed,
        latency_s=float(np.median(lat)),
        reads=len(picks),
        mode=store.mode,
    )
