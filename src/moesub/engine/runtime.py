"""The engine's per-layer driver: policy core step -> real copies -> compute from slots.

`OffloadEngine` is model-agnostic: the model adapter (`moesub.engine.adapter`, a Hugging Face
model) and the real-size benchmark (`moesub.engine.bench`, synthetic routing) both call, per
token and MoE layer, `route(layer, logits)` and then `compute(layer, hidden, slot_ids, weights,
host_ids)`.
Every policy decision comes from the one policy core (`moesub.policy.LayerCache`, external
admission mode): the engine only carries decisions out and tells the core when a background
copy has really completed (`LayerCache.admit`).

Admission timing (`admission=`):
- `"completion"` (default): a background copy that has completed by the layer's next token is
  admitted then, in completion order; a slow copy simply becomes usable later.
- `"delay"`: a request made at token t is admitted exactly at token `t + policy.delay` in
  (ready time, expert id) order, the core's own `delay` semantics; the engine blocks on the copy
  if it has not completed by then (`TokenStats.admit_wait_s`). Decisions are then those of the
  emulator and simulator for the same router logits, whatever the copies' speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from moesub.engine.kernels import grouped_experts
from moesub.policy import FETCH, FORCED, HOST, LayerCache, LayerStep, Policy

NUM_STATUS = 5
ADMISSION_TIMINGS = ("completion", "delay")


@dataclass
class TokenStats:
    """What one token cost, summed over layers."""

    fetch_wait_s: float = 0.0  # blocked on synchronous copies (incl. host_compute reads on disk)
    admit_wait_s: float = 0.0  # blocked on background copies due now (admission="delay" only)
    bytes_sync: int = 0
    bytes_bg: int = 0  # background admissions installed during this token
    counts: np.ndarray = field(default_factory=lambda: np.zeros(NUM_STATUS, np.int64))
    mass: float = 0.0  # substituted gate mass, summed over layers
    admissions: int = 0


class OffloadEngine:
    """Per-layer policy caches + a memory tier (`DiskTier` or `CudaTier`)."""

    def __init__(
        self,
        tier,
        num_experts: int,
        k: int,
        capacity: int,
        policy: Policy,
        initial: np.ndarray | None,
        act: Callable[[torch.Tensor], torch.Tensor],
        admission: str = "completion",
    ) -> None:
        if admission not in ADMISSION_TIMINGS:
            raise ValueError(f"admission={admission!r}: expected one of {ADMISSION_TIMINGS}")
        self.admission = admission
        self.tier = tier
        self.num_layers = len(tier.slots)
        self.num_experts, self.k, self.capacity = num_experts, k, capacity
        self.policy = policy
        self.act = act
        if initial is None:
            initial = np.tile(np.arange(capacity, dtype=np.int32), (self.num_layers, 1))
        initial = np.asarray(initial, dtype=np.int32)
        if initial.shape != (self.num_layers, capacity):
            raise ValueError(
                f"initial resident set: shape {initial.shape}, expected "
                f"(L={self.num_layers}, C={capacity})"
            )
        self.initial = initial
        self.caches: list[LayerCache] = []
        self.stats = TokenStats()
        # admission="delay": per layer, requests not yet admitted as (ready token, expert), and
        # completed copies not yet due (expert -> tier handle)
        self._due: list[list[tuple[int, int]]] = []
        self._landed: list[dict[int, tuple]] = []
        self.reset()

    def reset(self) -> None:
        """Fresh caches holding the initial set (start of a stream); slots reloaded, untimed."""
        self.tier.drain()
        self._due = [[] for _ in range(self.num_layers)]
        self._landed = [{} for _ in range(self.num_layers)]
        self.caches = [
            LayerCache(
                self.num_experts,
                self.k,
                self.capacity,
                self.policy,
                self.initial[layer],
                external_admission=True,
            )  # fmt: skip
            for layer in range(self.num_layers)
        ]
        for layer, cache in enumerate(self.caches):
            self.tier.load(layer, cache.resident())
        self.tier.synchronize()
        self.tier.take_wait_s()
        self.stats = TokenStats()

    def begin_token(self) -> None:
        self.stats = TokenStats()

    def end_token(self) -> TokenStats:
        """Synchronize the fast device and return the token's stats."""
        self.stats.fetch_wait_s += self.tier.take_wait_s()
        return self.stats

    def route(self, layer: int, logits: np.ndarray) -> LayerStep:
        """One token's router logits (1, E) float32 through the layer's policy core; carries out
        the decisions (admissions completed since the last call, synchronous fetches, new
        background admissions). Returns the core's step (slot = where each computed expert is)."""
        if logits.shape[0] != 1:
            raise ValueError(
                f"route: the engine decodes one token per step, got {logits.shape[0]} rows "
                "(a fetch for a later token could evict an expert an earlier one still needs)"
            )
        cache, tier, st = self.caches[layer], self.tier, self.stats
        # 1. background copies become resident: as they complete, or exactly when due
        if self.admission == "completion":
            self._admit_completed(layer)
        else:
            self._admit_due(layer)
        # 2. the policy core
        s = cache.step(logits)
        # 3. synchronous copies into the slots the core's evictions freed
        miss = (s.status == FETCH) | (s.status == FORCED)
        if miss.any():
            pairs = list(zip(s.selected[miss].tolist(), s.slot[miss].tolist(), strict=True))
            st.bytes_sync += tier.fetch(layer, pairs)
        # 4. admissions requested by this step run in the background
        for tok, expert in s.admissions.tolist():
            tier.request(layer, int(expert))
            st.admissions += 1
            if self.admission == "delay":
                self._due[layer].append((int(tok) + self.policy.delay, int(expert)))
        st.counts += np.bincount(s.status.reshape(-1), minlength=NUM_STATUS)
        st.mass += float(s.mass.sum())
        return s

    def _admit_completed(self, layer: int) -> None:
        """admission="completion": every copy of this layer that has completed, in that order."""
        cache, tier = self.caches[layer], self.tier
        for handle in tier.completed(layer):
            expert = handle[0]
            if expert in cache.resident():
                tier.discard(handle)  # fetched synchronously meanwhile
                cache.admit(expert)
                continue
            slot, _evicted = cache.admit(expert)
            self.stats.bytes_bg += tier.install(layer, handle, slot)

    def _admit_due(self, layer: int) -> None:
        """admission="delay": the requests due at this token, in (ready, expert) order, as the
        core applies them with a fixed delay; blocks on copies that have not completed yet.

        The core assigns every due expert its slot first (a later admission may evict an earlier
        one); each copy is then installed, or discarded, as it lands, which frees its staging
        buffer at once (the tiers' FIFO of requests then cannot stall on a due copy)."""
        cache, tier, t = self.caches[layer], self.tier, self.caches[layer].t
        pending = self._due[layer]
        due = sorted(r for r in pending if r[0] <= t)
        if not due:
            return
        self._due[layer] = [r for r in pending if r[0] > t]
        target = {}  # expert -> slot it must be copied into (absent: discard the copy)
        for _ready, expert in due:
            was_resident = expert in cache.resident()  # fetched synchronously meanwhile
            slot, _evicted = cache.admit(expert)
            if not was_resident:
                target[expert] = slot
        resident = cache.resident()
        target = {e: slot for e, slot in target.items() if resident[slot] == e}
        waiting = {e for _r, e in due}
        landed = self._landed[layer]
        t0 = time.perf_counter()
        while True:
            for handle in tier.completed(layer):
                landed[handle[0]] = handle
            for expert in waiting & landed.keys():
                handle = landed.pop(expert)
                if expert in target:
                    self.stats.bytes_bg += tier.install(layer, handle, target[expert])
                else:
                    tier.discard(handle)
                waiting.discard(expert)
            if not waiting:
                break
            time.sleep(5e-5)
        self.stats.admit_wait_s += time.perf_counter() - t0

    def compute(
        self,
        layer: int,
        hidden: torch.Tensor,
        slot_ids: torch.Tensor,
        weights: torch.Tensor,
        host_ids: np.ndarray | None = None,
    ) -> torch.Tensor:
        """hidden [N, H] -> routed expert output [N, H]. `slot_ids [N, k]` (cache slot, -1 = not
        on the fast tier), `weights [N, k]` gate weights in the same order, `host_ids [N, k]`
        (expert computed on the host, -1 = none) for host_compute misses."""
        slots = self.tier.slots[layer]
        out = grouped_experts(hidden, slot_ids, weights, slots.gate_up, slots.down, self.act)
        if host_ids is not None and (host_ids >= 0).any():
            host_out, nbytes = self.tier.host_forward(layer, hidden, host_ids, weights)
            self.stats.bytes_sync += nbytes
            out = out + host_out.to(out.dtype)
        return out

    def step_ids(self, s: LayerStep) -> tuple[np.ndarray, np.ndarray | None]:
        """(slot ids, host ids) in the core's rank order from a step: (N, k) int64 each."""
        slot = s.slot.astype(np.int64)
        host = None
        if (s.status == HOST).any():
            host = np.where(s.status == HOST, s.selected, -1).astype(np.int64)
        return slot, host

    def close(self) -> None:
        self.tier.close()
