"""The engine's background copies: which are in flight, which landed, the slots awaiting them,
waiting on them, and the bytes they installed.

A tier copies experts from its slow side in the background (`request`, `completed`, `install`,
`discard`: `DiskTier`, `CudaTier`). `BackgroundCopies` is the ledger of those copies, whatever
they are for: each carries a *purpose* (a label, e.g. the engine's admissions and prefetches;
another cause of a background upload is one more label) and the token it was requested at.
When the tier reports a copy complete, the ledger matches it to its request (the earliest in
flight for that layer and expert) and hands it to `on_landed`, the owner's decision: install it,
hold it for later, or drop it.

A slot the policy core has given an expert whose copy has not landed *awaits* that copy: no
kernel may read it until it is installed. `install` fills a slot only if it still awaits that
very expert (else the copy is dropped: the expert was evicted or fetched meanwhile).

Pinned slots (policy `pin`: the core keeps layer l's pinned experts in slots 0..pin_l-1 for the
whole stream) are never given to a copy: `await_copy` and `filled` (a synchronous fetch) refuse
them, so no staging install, prefetch or fetch can overwrite a pinned expert even if a caller
asked for it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

COPY_TIMEOUT_S = 60.0  # longest wait for a background copy before giving up
POLL_S = 5e-5  # between polls of the tier while blocked on a background copy


@dataclass(frozen=True)
class Copy:
    """One background copy as requested."""

    layer: int
    expert: int
    purpose: str  # what it is for (counts its bytes apart)
    token: int  # the owner's token count when it was requested


@dataclass(frozen=True)
class Landed:
    """A completed copy: its request and the tier's handle (install it or discard it, once)."""

    copy: Copy
    handle: tuple  # the tier's (expert, buffer, bytes)


class BackgroundCopies:
    """The background copies of one tier (all layers). `on_landed(landed)` is called for every
    completed copy, in the tier's completion order, whenever a layer is polled. `pins`: per
    layer, the number of pinned slots (0 for every layer when omitted)."""

    def __init__(
        self, tier, on_landed: Callable[[Landed], None], pins: Sequence[int] | None = None
    ) -> None:
        self.tier = tier
        self.num_layers = len(tier.slots)
        self.on_landed = on_landed
        self.pins = tuple(pins) if pins is not None else (0,) * self.num_layers
        if len(self.pins) != self.num_layers:
            raise ValueError(f"pins: {len(self.pins)} values for {self.num_layers} layers")
        self.reset()

    def reset(self) -> None:
        """Nothing in flight: the tier's copies drained, no slot awaiting, no bytes counted."""
        self.tier.drain()
        L = self.num_layers
        self._flight: list[collections.deque[Copy]] = [collections.deque() for _ in range(L)]
        self._awaiting: list[dict[int, int]] = [{} for _ in range(L)]  # slot -> expert to come
        self._bytes: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------------------- in flight
    def request(
        self, layer: int, expert: int, purpose: str, token: int, submit: bool = True
    ) -> None:
        """Start copying `expert` of `layer` in the background (`submit=False`: the ledger
        only; the owner has the tier start it later, `tier.request` or `then=` of
        `tier.host_begin`)."""
        if submit:
            self.tier.request(layer, expert)
        self._flight[layer].append(Copy(layer, expert, purpose, token))

    def poll(self, layer: int) -> None:
        """Hand every copy of `layer` that completed since the last poll to `on_landed`."""
        for handle in self.tier.completed(layer):
            self.on_landed(Landed(self._match(layer, handle[0]), handle))

    def _match(self, layer: int, expert: int) -> Copy:
        flight = self._flight[layer]
        for i, c in enumerate(flight):
            if c.expert == expert:
                del flight[i]
                return c
        raise RuntimeError(
            f"layer {layer}: a copy of expert {expert} landed that was never asked for"
        )

    def wait(self, pending: Callable[[], object], what: str) -> float:
        """Block until `pending()` is falsy, polling every layer (which also frees the staging
        buffers of landed copies for those still to come); returns the seconds waited. `what`
        names the wait in the error raised after `COPY_TIMEOUT_S`."""
        if not pending():
            return 0.0
        t0 = time.perf_counter()
        while True:
            for layer in range(self.num_layers):
                self.poll(layer)
            if not pending():
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > COPY_TIMEOUT_S:
                raise RuntimeError(
                    f"{what} did not land within {COPY_TIMEOUT_S} s (a copy that never "
                    "completes, or too few staging buffers for the copies in flight)"
                )
            time.sleep(POLL_S)

    # ---------------------------------------------------------------------------- slots
    def _unpinned(self, layer: int, slot: int, what: str) -> None:
        if slot < self.pins[layer]:
            raise RuntimeError(
                f"{what}: slot {slot} of layer {layer} holds a pinned expert (slots "
                f"0..{self.pins[layer] - 1}); it is never reused"
            )

    def await_copy(self, layer: int, slot: int, expert: int) -> None:
        """`slot` now belongs to `expert`, whose copy has not landed: no kernel may read it."""
        self._unpinned(layer, slot, f"a background copy of expert {expert}")
        self._awaiting[layer][slot] = expert

    def filled(self, layer: int, slot: int) -> None:
        """`slot` was filled otherwise (a synchronous fetch): it awaits no copy any more."""
        self._unpinned(layer, slot, "a synchronous fetch")
        self._awaiting[layer].pop(slot, None)

    def any_awaiting(self, layer: int, slots: Collection[int]) -> bool:
        return not self._awaiting[layer].keys().isdisjoint(slots)

    def install(self, landed: Landed, slot: int) -> bool:
        """Install a landed copy into `slot` (where its expert is resident, -1: nowhere) if that
        slot awaits it, counting its bytes under its purpose; else drop it. True if installed."""
        c = landed.copy
        awaiting = self._awaiting[c.layer]
        if awaiting.get(slot) != c.expert:
            self.tier.discard(landed.handle)
            return False
        del awaiting[slot]
        self._bytes[c.purpose] += self.tier.install(c.layer, landed.handle, slot)
        return True

    def discard(self, landed: Landed) -> None:
        self.tier.discard(landed.handle)

    def take_bytes(self) -> collections.Counter[str]:
        """Bytes installed per purpose since the last call (0 for a purpose with none)."""
        out, self._bytes = self._bytes, collections.Counter()
        return out
