"""Host memory behind the GPU: a bounded pinned budget, the expert store on disk behind it.

The CUDA tier's slow tier is built layer by layer from the expert store (`ExpertStore`): each
layer that fits in the pinned budget gets one `[E, 2I, H]` + `[E, H, I]` buffer pair, allocated
once, pinned at allocation (`torch.empty(..., pin_memory=True)`: no pageable copy pinned a
second time), and the store's experts are read straight into it. Layers past the budget stay on
disk and reach the GPU through small pinned bounce buffers (disk -> pinned RAM -> GPU, the
three-tier case of a GPU whose host has less RAM than the experts). At no point does the host
hold a second copy of an expert: peak host memory of the set-up is the budget plus the bounce
buffers (what `test_engine_memory` measures).

The pinned allocation is the only CUDA-specific step; it is injected (`alloc`), so the layout
and the accounting run, and are tested, on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moesub.engine.store import ExpertStore, StoreLayout

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised page-locked host memory, pinned at allocation (needs CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pageable_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class CountingAllocator:
    """An allocator that counts the bytes it hands out (the accounting seam of the tests)."""

    def __init__(self, alloc: Allocator = pageable_empty) -> None:
        self.alloc = alloc
        self.bytes = 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.alloc(shape, dtype)
        self.bytes += t.nbytes
        return t


def layers_within(layout: StoreLayout, budget_bytes: int | None) -> int:
    """How many whole layers of experts fit in `budget_bytes` of pinned memory (None: all)."""
    layer_bytes = layout.num_experts * layout.expert_bytes
    if budget_bytes is None:
        return layout.num_layers
    if budget_bytes < 0:
        raise ValueError(f"pinned budget must be >= 0 bytes, got {budget_bytes}")
    return min(layout.num_layers, budget_bytes // layer_bytes)


Fill = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, gate_up, down) written


class HostExperts:
    """Every expert of every layer on the host side of the GPU: the first layers in pinned
    memory (as many as `budget_bytes` holds), the rest read from `store` on demand.

    Without a store, `layout` and `fill(layer, gate_up, down)` give the pinned layers' contents
    (the benchmark's random experts), and every layer must fit in the budget."""

    def __init__(
        self,
        store: ExpertStore | None,
        budget_bytes: int | None = None,
        alloc: Allocator = pinned_empty,
        *,
        layout: StoreLayout | None = None,
        fill: Fill | None = None,
    ) -> None:
        if (store is None) == (fill is None) or (store is None and layout is None):
            raise ValueError("HostExperts: give either a store, or a layout and a fill function")
        lay = store.layout if store is not None else layout
        self.store, self.layout, self.alloc = store, lay, alloc
        self.budget_bytes = budget_bytes
        n_pinned = layers_within(lay, budget_bytes)
        if store is None and n_pinned < lay.num_layers:
            raise ValueError(
                f"pinned budget {budget_bytes} B holds {n_pinned} of {lay.num_layers} layers, "
                "and there is no expert store for the others"
            )
        E = lay.num_experts
        self.pinned: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for layer in range(lay.num_layers):
            if layer >= n_pinned:
                self.pinned.append(None)
                continue
            gu = alloc((E, *lay.gate_up_shape), lay.torch_dtype)
            dn = alloc((E, *lay.down_shape), lay.torch_dtype)
            if store is None:
                fill(layer, gu, dn)
            else:
                for e in range(E):  # straight from the file into the pinned buffer
                    store.read_into(layer, e, gu[e], dn[e])
            self.pinned.append((gu, dn))

    @property
    def expert_bytes(self) -> int:
        return self.layout.expert_bytes

    @property
    def pinned_layers(self) -> int:
        return sum(p is not None for p in self.pinned)

    @property
    def pinned_bytes(self) -> int:
        return sum(p[0].nbytes + p[1].nbytes for p in self.pinned if p is not None)

    @property
    def disk_layers(self) -> list[int]:
        return [layer for layer, p in enumerate(self.pinned) if p is None]

    def on_disk(self, layer: int) -> bool:
        return self.pinned[layer] is None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A pinned layer's `(E, 2I, H)`, `(E, H, I)` buffers (ValueError for a disk layer)."""
        p = self.pinned[layer]
        if p is None:
            raise ValueError(f"layer {layer} is on disk, not in pinned memory")
        return p

    def read_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """One expert into host buffers: a copy from pinned memory, or a read from disk."""
        p = self.pinned[layer]
        if p is None:
            return self.store.read_into(layer, expert, gate_up, down)
        gate_up.copy_(p[0][expert])
        down.copy_(p[1][expert])
        return 0  # no disk bytes moved

    def describe(self) -> str:
        lay = self.layout
        n = self.pinned_layers
        if n == lay.num_layers:
            return f"all {n} layers in pinned host memory ({self.pinned_bytes / 2**30:.2f} GiB)"
        return (
            f"{n} of {lay.num_layers} layers in pinned host memory "
            f"({self.pinned_bytes / 2**30:.2f} GiB, budget {self.budget_bytes / 2**30:.2f} GiB), "
            f"the other {lay.num_layers - n} read from {self.store.path.name} ({self.store.mode})"
        )
