"""The engine's per-layer driver: policy core step -> real copies -> compute from slots.

`OffloadEngine` is model-agnostic: the model adapter (`moesub.engine.adapter`, a Hugging Face
model) and the real-size benchmark (`moesub.engine.bench`, synthetic routing) both call, per
token, `begin_token()`, then per MoE layer `route(layer, logits)` and `compute(layer, hidden,
slot_ids, weights, host)`, then `end_token()`; with `policy.prefetch > 0` also
`prefetch(layer, lookahead)` one MoE layer early (or the lookahead given to `route`). The
router's values reach the host once per layer (`tier.to_host`, one counted synchronization);
the slot ids of the computed experts stay on the host, where the expert kernel plans its work
(`moesub.engine.kernels`). Every policy decision comes from the one policy core
(`moesub.policy.LayerCache`, external admission mode): the engine only carries decisions out
and tells the core when a background copy has really completed (`LayerCache.admit`).

Background copies (`moesub.engine.copies.BackgroundCopies`, the ledger of the tier's
`request` / `completed` / `install` / `discard`) serve the core's admissions and speculative
prefetches; the engine decides what each landed copy does. A slot the core has given an expert
whose copy has not landed yet *awaits* it: no kernel reads it (the engine waits for the copy
first); a copy that lands for an expert no longer in its slot is discarded.

Admission timing (`admission=`):
- `"completion"` (default): at the start of every token, every admission copy that has
  completed (all layers) is admitted, in completion order; a slow copy becomes usable later.
  Prefetch: layer l's step runs at once; a prefetched expert the step computes whose copy has
  not landed is waited for (late, `TokenStats.prefetch_wait_s`), the others land in the
  background.
- `"delay"`: a request made at token t is admitted exactly at token `t + policy.delay` in
  (ready time, expert id) order, the core's own `delay` semantics; the engine blocks on the copy
  if it has not completed by then (`TokenStats.admit_wait_s`), and on every prefetch copy of
  layer l before layer l's step. Decisions are then those of the emulator and simulator for the
  same router logits (and lookahead logits), whatever the copies' speed.

Prefetch (policy semantics v2, step 1b): at MoE layer l-1 the caller hands layer l's lookahead
logits to `prefetch(l, y)`; the engine copies the experts of `P` (the n largest of `y`, ties to
the lower id) that are not resident in the background, while layer l-1's experts and layer l's
attention compute. The core inserts exactly those in its step 1b at layer l (checked: the
prediction uses only the residency the core reports); the copies are then installed into the
slots the core chose.

Host experts (`host_compute`, `light_miss="host"`): `compute` starts the host's experts on the
tier (on the disk tier a worker thread reads them while the slots' experts are computed, then
the caller computes them; on CUDA the CPU computes while the GPU runs the slot kernels queued
before) and waits for both (`TokenStats.host_wait_s`). The layer's output is the
sum over ranks of the weighted rows wherever each was computed (`expert_forward(per_rank=True)`),
so a lossless policy computes bit for bit what every expert in a slot would. `host_admit`
(policy v3): the core hands the uploads of host-computed experts over as admissions; each is a
background copy like beta's (disk: the I/O thread reads the expert again, once the worker has
read the host's experts, so that the layer never waits on an upload; CUDA: pinned memory -> GPU
on the side stream, after the host's experts where their layer is on disk), admitted under
either timing below.

Policy v3 (docs/policy-semantics.md): each layer has its own capacity `C_l` (the tier's slots of
that layer) and initial set; `pin` keeps the first `pin_l` experts of layer l's initial set in
slots 0..pin_l-1 for the whole stream. The core never evicts them, and the copies' ledger
(`BackgroundCopies`) refuses any copy or fetch into those slots.

Per token the engine counts what each layer's policy did in `TOKEN_LAYER_FIELDS` layout
(`TokenStats.layer_counts`, the pricing's input): the core's step (statuses, prefetched,
requested) and the admissions that landed (inserted) at the layer during the token.

Prompt prefill (generation): `route_prefill` steps a prompt's rows through the core one row at
a time (token-by-token decisions; admissions at the core's delay, as the emulator's prefill),
`adapter.prefill_forward` computes their experts from the slow tier, and `end_prefill` reloads
the slots from the core's residency and requests the admissions still pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from moesub.engine.copies import BackgroundCopies, Landed
from moesub.engine.kernels import expert_forward
from moesub.engine.token_stats import LANDED, NUM_FIELDS, TokenStats
from moesub.policy import (
    FETCH,
    FORCED,
    HOST,
    LayerCache,
    LayerStep,
    Policy,
    check_layers,
    token_layer_counts,
)

ADMISSION_TIMINGS = ("completion", "delay")
# what a background copy is for (host uploads are admissions: the core hands them over alike,
# and a policy makes only one kind)
ADMISSION, PREFETCH = "admission", "prefetch"


@dataclass(frozen=True)
class HostInputs:
    """One layer's host_compute misses, with their inputs on the host: ids (N, k) expert or -1 in
    the order of `weights [N, k]`, and the hidden state [N, H]."""

    ids: np.ndarray
    hidden: torch.Tensor
    weights: torch.Tensor


def top_n(y: np.ndarray, n: int) -> np.ndarray:
    """The n largest of a row, ties to the lower id (the core's selection order)."""
    return np.argsort(-y, kind="stable")[:n]


class OffloadEngine:
    """Per-layer policy caches + a memory tier (`DiskTier` or `CudaTier`).

    `capacity`: an int (every layer) or L ints `C_l`, the tier's slots per layer; `initial`:
    None (experts 0..C_l-1), an (L, C) array or L 1-D arrays of lengths C_l, as `scan` takes
    them (`moesub.policy.check_layers`: the policy's pins and prefetch must fit every layer)."""

    def __init__(
        self,
        tier,
        num_experts: int,
        k: int,
        capacity: int | Sequence[int],
        policy: Policy,
        initial: np.ndarray | Sequence[np.ndarray] | None,
        act: Callable[[torch.Tensor], torch.Tensor],
        admission: str = "completion",
    ) -> None:
        if admission not in ADMISSION_TIMINGS:
            raise ValueError(f"admission={admission!r}: expected one of {ADMISSION_TIMINGS}")
        self.num_layers = len(tier.slots)
        layers = check_layers(policy, k, capacity, initial, self.num_layers, num_experts)
        slots = tuple(s.capacity for s in tier.slots)
        if slots != layers.capacities:
            raise ValueError(
                f"capacity: the tier holds {list(slots)} slots per layer, the policy's caches "
                f"{list(layers.capacities)}"
            )
        self.admission = admission
        self.tier = tier
        self.num_experts, self.k = num_experts, k
        self.capacities, self.pins, self.initial = layers.capacities, layers.pins, layers.initials
        self.policy = policy
        self.act = act
        self.copies = BackgroundCopies(tier, self._on_landed, self.pins)
        self.caches: list[LayerCache] = []
        self._held: list[list[Landed]] = []  # per layer: admissions landed, not applied
        self._pf_landed: list[dict[int, Landed]] = []  # per layer: prefetches landed early
        self.stats = TokenStats()
        self.token = 0  # tokens begun since the last reset
        self.prefilling = False  # a prompt's rows are being routed (until end_prefill)
        self._syncs_at_begin = 0
        self.reset()

    def reset(self, load: bool = True) -> None:
        """Fresh caches holding the initial set (start of a stream); slots reloaded, untimed
        (`load=False`: not yet, a prefill follows and `end_prefill` loads them)."""
        self._drop_landed()
        self.copies.reset()
        self.prefilling = False
        L = self.num_layers
        self._held = [[] for _ in range(L)]
        self._due: list[list[tuple[int, int]]] = [[] for _ in range(L)]  # (ready token, expert)
        self._assigned: list[list[int]] = [[] for _ in range(L)]  # delay: admitted, not landed
        self._issued: list[list[int]] = [[] for _ in range(L)]  # prefetched for the next step
        self._after_host: list[list[int]] = [[] for _ in range(L)]  # held for the host's reads
        self._pf_landed = [{} for _ in range(L)]
        self._lookahead: list[np.ndarray | None] = [None] * L
        self.caches = [
            LayerCache(
                self.num_experts,
                self.k,
                self.capacities[layer],
                self.policy.for_layer(layer),
                self.initial[layer],
                external_admission=True,
            )  # fmt: skip
            for layer in range(L)
        ]
        for layer, cache in enumerate(self.caches):
            if load:
                self.tier.load(layer, cache.resident())
        self.tier.synchronize()
        self.tier.take_wait_s()
        self.stats = self._fresh_stats()
        self.token = 0

    def _fresh_stats(self) -> TokenStats:
        return TokenStats(layer_counts=np.zeros((self.num_layers, NUM_FIELDS), np.int64))

    def begin_token(self) -> None:
        """Start a token: with admission="completion", every admission copy that has completed
        (all layers) is installed now, which also frees its staging buffer for new requests."""
        self.token += 1
        self.stats = self._fresh_stats()
        self._syncs_at_begin = self.tier.syncs.count
        self.tier.begin_token()
        for layer in range(self.num_layers):
            self.copies.poll(layer)
            if self.admission == "completion":
                self._admit_held(layer)

    def end_token(self) -> TokenStats:
        """Wait for the token's compute (the compute stream only: background copies go on) and
        return the token's stats."""
        self.tier.token_sync()
        self.stats.fetch_wait_s += self.tier.take_wait_s()
        moved = self.copies.take_bytes()
        self.stats.bytes_bg += moved[ADMISSION]
        self.stats.bytes_prefetch += moved[PREFETCH]
        self.stats.syncs = self.tier.syncs.count - self._syncs_at_begin
        return self.stats

    def to_host(self, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The router's values of a layer on the host (one counted wait for the device)."""
        return self.tier.to_host(layer, *tensors)

    # ------------------------------------------------------------------------- prefetch
    def prefetch(self, layer: int, lookahead: np.ndarray) -> None:
        """Layer `layer`'s lookahead logits (1, E) float32, known one MoE layer early: the
        experts the core's step 1b will insert are copied in the background from now on."""
        if self.policy.prefetch == 0 or self.prefilling:  # (route_prefill takes its own)
            return
        y = np.array(lookahead, dtype=np.float32)  # a copy: the caller may reuse its buffer
        if y.shape != (1, self.num_experts):
            raise ValueError(f"lookahead: expected shape (1, {self.num_experts}), got {y.shape}")
        if not np.isfinite(y).all():
            raise ValueError(f"lookahead of layer {layer}: NaN or inf")
        if self._lookahead[layer] is not None:
            raise RuntimeError(f"prefetch: layer {layer} prefetched twice before its step")
        if self.admission == "delay":  # step 1 (due admissions) comes before step 1b
            self._assign_due(layer)
        self._lookahead[layer] = y
        resident = set(self.caches[layer].resident().tolist())
        issued = [int(e) for e in top_n(y[0], self.policy.prefetch) if int(e) not in resident]
        for e in issued:
            self.copies.request(layer, e, PREFETCH, self.token)
        self._issued[layer] = issued
        self.stats.prefetches += len(issued)

    # ------------------------------------------------------------------------- one layer
    def route(
        self, layer: int, logits: np.ndarray, lookahead: np.ndarray | None = None
    ) -> LayerStep:
        """One token's router logits (1, E) float32 through the layer's policy core; carries out
        the decisions (due admissions, prefetches, synchronous fetches, new background
        admissions). `lookahead` (1, E): when `prefetch` was not called for this layer and token
        (no overlap then). Returns the core's step (slot = where each computed expert is)."""
        if logits.shape[0] != 1:
            raise ValueError(
                f"route: the engine decodes one token per step, got {logits.shape[0]} rows "
                "(a fetch for a later token could evict an expert an earlier one still needs)"
            )
        cache, tier, st = self.caches[layer], self.tier, self.stats
        if self.policy.prefetch > 0 and self._lookahead[layer] is None:
            if lookahead is None:
                raise ValueError(
                    f"route: policy prefetch > 0 needs layer {layer}'s lookahead logits "
                    "(engine.prefetch one layer early, or lookahead=)"
                )
            self.prefetch(layer, lookahead)
        # 1. step 1 (admission="delay"): the copies due now are installed before the step
        if self.admission == "delay":
            if self.policy.prefetch == 0:
                self._assign_due(layer)
            self._wait(layer, lambda: self._assigned[layer], "admit_wait_s")
        # 1b. prefetch copies: timeliness, and (delay) every one landed before the step
        self.copies.poll(layer)
        issued, landed = self._issued[layer], self._pf_landed[layer]
        st.prefetch_in_time += sum(e in landed for e in issued)
        if self.admission == "delay":
            self._wait(layer, lambda: len(landed) < len(issued), "prefetch_wait_s")
        # 2. the policy core
        s = cache.step(logits, self._lookahead[layer])
        self._lookahead[layer] = None
        if self.policy.prefetch > 0 and int(s.prefetched[0]) != len(issued):
            raise RuntimeError(
                f"prefetch: layer {layer}'s core inserted {int(s.prefetched[0])} experts, the "
                f"engine copied {len(issued)} (its residency changed between prefetch and step)"
            )
        # 3. synchronous copies into the slots the core's evictions freed
        miss = (s.status == FETCH) | (s.status == FORCED)
        if miss.any():
            pairs = list(zip(s.selected[miss].tolist(), s.slot[miss].tolist(), strict=True))
            for _e, slot in pairs:
                self.copies.filled(layer, slot)
            st.bytes_sync += tier.fetch(layer, pairs)
        # 4. prefetched experts: installed if landed, else their slots wait for the copies; a
        # computed one must be there before the kernels run (late: waited for)
        self._settle_prefetches(layer)
        computed = set(s.slot[s.slot >= 0].tolist())
        self._wait(layer, lambda: self.copies.any_awaiting(layer, computed), "prefetch_wait_s")
        # 5. admissions requested by this step run in the background. Where the host reads its
        # experts over the link (the disk tier), they start once the host's reads are done
        # (`compute`): the layer waits on those reads, not on copies for later tokens
        held = self.tier.host_reads_link and bool((s.status == HOST).any())
        for tok, expert in s.admissions.tolist():
            self.copies.request(layer, int(expert), ADMISSION, self.token, submit=not held)
            if held:
                self._after_host[layer].append(int(expert))
            st.admissions += 1
            if self.admission == "delay":
                self._due[layer].append((int(tok) + self.policy.delay, int(expert)))
        st.layer_counts[layer] += token_layer_counts(s)[0]  # landings: `_land`
        st.mass += float(s.mass.sum())
        return s

    def _settle_prefetches(self, layer: int) -> None:
        """After the step: each prefetched expert still resident is installed (landed) or its
        slot awaits the copy; a landed copy of one evicted meanwhile is dropped."""
        resident = self.caches[layer].resident()
        landed = self._pf_landed[layer]
        for e in self._issued[layer]:
            where = np.flatnonzero(resident == e)
            copy = landed.pop(e, None)
            if len(where) == 0:
                if copy is not None:
                    self.copies.discard(copy)
                continue
            slot = int(where[0])
            self.copies.await_copy(layer, slot, e)
            if copy is not None:
                self.copies.install(copy, slot)
        self._issued[layer] = []

    # ------------------------------------------------------------------------- copies landing
    def _on_landed(self, landed: Landed) -> None:
        """A background copy has completed: hold it, install it, or drop it."""
        c = landed.copy
        layer, e = c.layer, c.expert
        if c.purpose == PREFETCH:
            if c.token == self.token and e in self._issued[layer]:
                self._pf_landed[layer][e] = landed  # its step has not run yet
            else:
                self._install(landed)
        elif self.admission == "delay" and e in self._assigned[layer]:
            self._assigned[layer].remove(e)  # due already: the core gave it a slot
            if self._install(landed):
                self._count_admitted(c.token)
        else:  # admitted at the next token (completion) or when due (delay)
            self._held[layer].append(landed)

    def _install(self, landed: Landed) -> bool:
        """Install a landed copy into its expert's slot if that slot awaits it; else drop it."""
        c = landed.copy
        where = np.flatnonzero(self.caches[c.layer].resident() == c.expert)
        return self.copies.install(landed, int(where[0]) if len(where) else -1)

    def _count_admitted(self, request_token: int) -> None:
        self.stats.admitted += 1
        self.stats.admit_latency += self.token - request_token

    def _land(self, layer: int, e: int) -> bool:
        """The core admits `e` (step 1); its slot awaits the copy unless `e` was resident
        already (fetched or prefetched meanwhile: then nothing lands). True if it landed."""
        cache = self.caches[layer]
        was_resident = e in cache.resident()
        slot, _evicted = cache.admit(e)
        if was_resident:
            return False
        self.copies.await_copy(layer, slot, e)
        self.stats.layer_counts[layer, LANDED] += 1
        return True

    def _admit_held(self, layer: int) -> None:
        """admission="completion": every landed admission copy of this layer, in that order."""
        held, self._held[layer] = self._held[layer], []
        for landed in held:
            landed_now = self._land(layer, landed.copy.expert)
            if self._install(landed) and landed_now:
                self._count_admitted(landed.copy.token)

    def _assign_due(self, layer: int) -> None:
        """admission="delay": the requests due at this token get their slots from the core, in
        (ready, expert) order, as the core applies them with a fixed delay (a later admission
        may evict an earlier one); copies that landed already are installed at once."""
        t = self.caches[layer].t
        pending = self._due[layer]
        due = sorted(r for r in pending if r[0] <= t)
        if not due:
            return
        self._due[layer] = [r for r in pending if r[0] > t]
        for _ready, e in due:
            self._land(layer, e)
            self._assigned[layer].append(e)
        held, self._held[layer] = self._held[layer], []
        for landed in held:
            e = landed.copy.expert
            if e in self._assigned[layer]:
                self._assigned[layer].remove(e)
                if self._install(landed):
                    self._count_admitted(landed.copy.token)
            else:
                self._held[layer].append(landed)

    def _wait(self, layer: int, pending: Callable[[], object], what: str) -> None:
        """Block until `pending()` is falsy (`BackgroundCopies.wait`); the time goes to
        stats.`what`."""
        if pending():
            name = f"{what}: layer {layer}'s background copies requested for token {self.token}"
            waited = self.copies.wait(pending, name)
            setattr(self.stats, what, getattr(self.stats, what) + waited)

    # ------------------------------------------------------------------------- prompt prefill
    def route_prefill(
        self, layer: int, logits: np.ndarray, lookahead: np.ndarray | None = None
    ) -> LayerStep:
        """A prompt's rows (T, E) through the layer's core, one row at a time, admissions
        applied at the core's delay; no copies (see `end_prefill`)."""
        if not self.prefilling:
            raise RuntimeError("route_prefill: begin a token and set prefilling first")
        cache, steps = self.caches[layer], []
        for i in range(logits.shape[0]):
            due = sorted(r for r in self._due[layer] if r[0] <= cache.t)
            self._due[layer] = [r for r in self._due[layer] if r[0] > cache.t]
            for _ready, e in due:
                cache.admit(e)
            y = None if lookahead is None else lookahead[i : i + 1]
            s = cache.step(logits[i : i + 1], y)
            self._due[layer] += [(t + self.policy.delay, e) for t, e in s.admissions.tolist()]
            steps.append(s)
        return LayerStep(*(np.concatenate([getattr(s, f.name) for s in steps]) for f in
                           fields(LayerStep)))  # fmt: skip

    def end_prefill(self) -> None:
        """After a prompt's rows: the slots hold the core's residents (loaded, untimed), the
        admissions still pending are requested (due at the core's delay, or when they land)."""
        for layer, cache in enumerate(self.caches):
            self.tier.load(layer, cache.resident())
        self.tier.synchronize()
        for layer in range(self.num_layers):
            for _ready, e in self._due[layer]:
                self.copies.request(layer, e, ADMISSION, self.token)
            if self.admission == "completion":
                self._due[layer] = []
        self.prefilling = False

    # ------------------------------------------------------------------------- compute
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
        the fast device), `host` the host's experts (HOST status) with their host-side inputs.

        The host's experts start first on the tier (concurrently with what follows), the slot
        kernels run, then the layer waits for the host's result, which goes back to the device
        without a wait (through pinned memory on CUDA)."""
        tier = self.tier
        job = None
        if host is not None and (host.ids >= 0).any():
            held, self._after_host[layer] = self._after_host[layer], []
            job = tier.host_begin(layer, host.hidden, host.ids, host.weights, then=held)
        elif self._after_host[layer]:
            raise RuntimeError(
                f"compute: layer {layer}'s step had host experts, but none were given (host=); "
                "their uploads wait for the host's reads"
            )
        slots = tier.slots[layer]
        out = expert_forward(
            hidden, slot_ids, weights, slots.gate_up, slots.down, self.act, tier.path,
            upload=lambda a: tier.upload(layer, a), per_rank=job is not None,
        )  # fmt: skip
        if job is not None:
            t0 = time.perf_counter()
            host_rows, nbytes = tier.host_end(job)
            self.stats.host_wait_s += time.perf_counter() - t0
            self.stats.bytes_host += nbytes
            out = (out + host_rows.to(out.dtype)).sum(dim=1)  # each rank's row is in one of them
        return out

    def step_ids(self, s: LayerStep) -> tuple[np.ndarray, np.ndarray | None]:
        """(slot ids, host ids) in the core's rank order from a step: (N, k) int64 each."""
        slot = s.slot.astype(np.int64)
        host = None
        if (s.status == HOST).any():
            host = np.where(s.status == HOST, s.selected, -1).astype(np.int64)
        return slot, host

    def _drop_landed(self) -> None:
        """Landed copies the engine holds (admissions not yet applied, prefetches whose step
        has not run) give their staging buffers back (a stream's end, or closing)."""
        for landed in [c for held in self._held for c in held] + [
            c for pf in self._pf_landed for c in pf.values()
        ]:
            self.copies.discard(landed)
        self._held = [[] for _ in self._held]
        self._pf_landed = [{} for _ in self._pf_landed]

    def close(self) -> None:
        self._drop_landed()
        self.tier.close()
