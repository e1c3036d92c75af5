"""The engine's per-layer driver: policy core step -> real copies -> compute from slots.

`OffloadEngine` is model-agnostic: the model adapter (`moesub.engine.adapter`, a Hugging Face
model) and the real-size benchmark (`moesub.engine.bench`, synthetic routing) both call, per
token, `begin_token()`, then per MoE layer `route(layer, logits)` and `compute(layer, hidden,
slot_ids, weights, host)`, then `end_token()`. The router's values reach the host once per layer
(`tier.to_host`, one counted synchronization); the slot ids of the computed experts stay on the
host, where the expert kernel plans its work (`moesub.engine.kernels`).
Every policy decision comes from the one policy core (`moesub.policy.LayerCache`, external
admission mode): the engine only carries decisions out and tells the core when a background
copy has really completed (`LayerCache.admit`).

Admission timing (`admission=`):
- `"completion"` (default): at the start of every token, every background copy that has
  completed (all layers) is admitted, in completion order; a slow copy becomes usable later.
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

from moesub.engine.kernels import expert_forward
from moesub.policy import FETCH, FORCED, HOST, STATUS_NAMES, LayerCache, LayerStep, Policy

NUM_STATUS = len(STATUS_NAMES)
ADMISSION_TIMINGS = ("completion", "delay")
ADMIT_TIMEOUT_S = 60.0  # admission="delay": longest wait for a due copy before giving up


@dataclass
class TokenStats:
    """What one token cost, summed over layers."""

    fetch_wait_s: float = 0.0  # blocked on synchronous copies (incl. host_compute reads on disk)
    admit_wait_s: float = 0.0  # blocked on background copies due now (admission="delay" only)
    bytes_sync: int = 0
    bytes_bg: int = 0  # background admissions installed during this token
    counts: np.ndarray = field(default_factory=lambda: np.zeros(NUM_STATUS, np.int64))
    mass: float = 0.0  # substituted gate mass, summed over layers
    admissions: int = 0  # admission requests made during this token
    admitted: int = 0  # background copies installed during this token
    admit_latency: int = 0  # tokens from request to install, summed over those installed
    syncs: int = 0  # host waits for the device (`HostSync`), router reads and token end


@dataclass(frozen=True)
class HostInputs:
    """One layer's host_compute misses, with their inputs on the host: ids (N, k) expert or -1 in
    the order of `weights [N, k]`, and the hidden state [N, H]."""

    ids: np.ndarray
    hidden: torch.Tensor
    weights: torch.Tensor


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
        self.token = 0  # tokens begun since the last reset
        self._syncs_at_begin = 0
        # admission="delay": per layer, requests not yet admitted as (ready token, expert), and
        # completed copies not yet due (expert -> tier handle)
        self._due: list[list[tuple[int, int]]] = []
        self._landed: list[dict[int, tuple]] = []
        self._requested: list[dict[int, list[int]]] = []  # layer -> expert -> request tokens
        self.reset()

    def reset(self) -> None:
        """Fresh caches holding the initial set (start of a stream); slots reloaded, untimed."""
        self.tier.drain()
        self._due = [[] for _ in range(self.num_layers)]
        self._landed = [{} for _ in range(self.num_layers)]
        self._requested = [{} for _ in range(self.num_layers)]
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
        self.token = 0

    def begin_token(self) -> None:
        """Start a token: with admission="completion", every background copy that has completed
        (all layers) is installed now, which also frees its staging buffer for new requests."""
        self.token += 1
        self.stats = TokenStats()
        self._syncs_at_begin = self.tier.syncs.count
        self.tier.begin_token()
        if self.admission == "completion":
            for layer in range(self.num_layers):
                self._admit_completed(layer)

    def end_token(self) -> TokenStats:
        """Wait for the token's compute (the compute stream only: background copies go on) and
        return the token's stats."""
        self.tier.token_sync()
        self.stats.fetch_wait_s += self.tier.take_wait_s()
        self.stats.syncs = self.tier.syncs.count - self._syncs_at_begin
        return self.stats

    def to_host(self, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The router's values of a layer on the host (one counted wait for the device)."""
        return self.tier.to_host(layer, *tensors)

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
        # 1. background copies due now become resident (admission="delay"; with "completion"
        # they were installed at the start of the token)
        if self.admission == "delay":
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
            self._requested[layer].setdefault(int(expert), []).append(self.token)
            st.admissions += 1
            if self.admission == "delay":
                self._due[layer].append((int(tok) + self.policy.delay, int(expert)))
        st.counts += np.bincount(s.status.reshape(-1), minlength=NUM_STATUS)
        st.mass += float(s.mass.sum())
        return s

    def _installed(self, layer: int, expert: int, installed: bool = True) -> None:
        """A requested copy landed: installed (latency in tokens counted) or not needed."""
        tokens = self._requested[layer].get(expert)
        if tokens:
            requested = tokens.pop(0)
            if installed:
                self.stats.admitted += 1
                self.stats.admit_latency += self.token - requested

    def _admit_completed(self, layer: int) -> None:
        """admission="completion": every copy of this layer that has completed, in that order."""
        cache, tier = self.caches[layer], self.tier
        for handle in tier.completed(layer):
            expert = handle[0]
            if expert in cache.resident():
                tier.discard(handle)  # fetched synchronously meanwhile
                cache.admit(expert)
                self._installed(layer, expert, installed=False)
                continue
            slot, _evicted = cache.admit(expert)
            self.stats.bytes_bg += tier.install(layer, handle, slot)
            self._installed(layer, expert)

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
                    self._installed(layer, expert)
                else:
                    tier.discard(handle)
                    self._installed(layer, expert, installed=False)
                waiting.discard(expert)
            if not waiting:
                break
            if time.perf_counter() - t0 > ADMIT_TIMEOUT_S:
                raise RuntimeError(
                    f"admission: layer {layer}, experts {sorted(waiting)} requested for token "
                    f"{t} did not land within {ADMIT_TIMEOUT_S} s (a copy that never completes, "
                    "or too few staging buffers for the admissions in flight)"
                )
            time.sleep(5e-5)
        self.stats.admit_wait_s += time.perf_counter() - t0

    def compute(
        self,
        layer: int,
        hidden: torch.Tensor,
        slot_ids: np.ndarray,
        weights: torch.Tensor,
        host: HostInputs | None = None,
    ) -> torch.Tensor:
        """hidden [N, H] -> routed expert output [N, H]. `slot_ids (N, k)` host array (cache
        slot, -1 = not on the fast tier), `weights [N, k]` gate weights in the same order (on
        the fast device), `host` the host_compute misses with their host-side inputs.

        The slot kernels are queued first; the host computes its misses while they run, and
        its result goes back to the device without a wait (through pinned memory on CUDA)."""
        tier = self.tier
        slots = tier.slots[layer]
        out = expert_forward(
            hidden, slot_ids, weights, slots.gate_up, slots.down, self.act, tier.path,
            upload=lambda a: tier.upload(layer, a),
        )  # fmt: skip
        if host is not None and (host.ids >= 0).any():
            host_out, nbytes = tier.host_forward(layer, host.hidden, host.ids, host.weights)
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
