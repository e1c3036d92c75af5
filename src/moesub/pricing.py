"""Overlap-aware pricing: seconds per token from each token-layer's own counts.

Input, per stream: an integer array (T, L, F) of what the policy did at every token-layer
(`TOKEN_LAYER_FIELDS`: experts hit, fetched, substituted, computed by the host, force-fetched;
experts prefetched in step 1b; background copies requested (admissions and host uploads) and
admissions landed in step 1), the policy's `delay`, and a hardware profile priced for the model
(`moesub.hardware.UnitCosts`). Output: seconds per token and where they went (`BREAKDOWN`).

Time flows token by token, layer by layer within a token, on one clock (the fast tier's), with
one link that carries every copy in the order asked (FIFO). A layer (docs/pricing.md, which also
says where this simplifies the engine):

1. its dense work (`dense_layer_s`); layer 0 first queues its own prefetch copies, and after
   the dense work of layer l the prefetch copies of layer l+1 are queued (the engine issues them
   when layer l's MoE block starts, one MoE layer early);
2. step 1: the admissions landing now wait for their copies (requested `delay` tokens earlier
   at this layer, FIFO on the link), then each is installed (`install_s`);
3. step 1b: the prefetched experts wait for their copies, then each is installed;
4. the decision: synchronous copies (fetch, forced) queue on the link behind every copy already
   queued; then, where the host reads its experts over the link (`host_reads_link`: the disk
   tier, whose host computes each from a fresh disk read), the host's reads (`host_read_s`
   each: they come back to back, at their own speed);
   then this token-layer's background requests (the engine starts them once the host's reads
   are done, so that no layer waits on a copy for a later token);
5. the fast path: the synchronous copies and, where there are any, the step's wait for them
   (`sync_step_s`: issuing them and resuming), then the fast tier's experts (hit, fetch, sub,
   forced, `expert_s` each); the host path: the host's experts (`host_expert_s` each, and
   `host_step_s` once where there are any: handing them over, taking the results back), starting
   at the decision, or where it reads them over the link once its reads are done
   (`host_expert_s` is then the compute alone). With `concurrent_host` the layer ends when both
   paths have (max); else the host computes after the fast path and its own reads (the reads
   overlap the fast path: the disk tier's worker reads while the main thread computes).

Where the host reads over the link (the disk tier's worker and I/O thread take CPU time and
memory bandwidth from the fast tier), the fast tier's work (overhead, dense, installs, experts)
runs `1 + background_read_drag` times slower while the link reads background copies, and its
experts `1 + host_read_drag` times slower while it reads the host's; without `concurrent_host`
the host's compute, on the same processor, runs `1 + background_read_drag` times slower while
the link reads that step's background copies (its uploads); those seconds are the `read_drag` part.
A batch of background copies (a step's requests, a layer's prefetches) queued while no earlier
background copy is still on the link costs the fast tier `background_start_s` once (the disk
tier's I/O thread started from idle: measured); the `background_start` part.

A token's time is the clock's advance over its layers plus `token_overhead_s`. The link and
the copies in flight restart with every stream (as the caches do).

`price_stream_reference` is that description in plain Python; `price_stream` is the compiled
core's (`csrc/pricing.cpp`), held equal to it exactly by tests/test_pricing.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from moesub import _core
from moesub.hardware import UnitCosts
from moesub.vocabulary import TOKEN_LAYER_FIELDS

HIT, FETCH, SUB, HOST, FORCED, PREFETCHED, REQUESTS, LANDED = range(len(TOKEN_LAYER_FIELDS))
# where a stream's seconds went; the parts sum to its time
BREAKDOWN = (
    "overhead",  # token_overhead_s per token
    "dense",  # dense_layer_s per token-layer
    "admit_wait",  # step 1: admissions whose copy had not landed
    "prefetch_wait",  # step 1b: prefetch copies not landed (late prefetches)
    "install",  # landed background copies installed on the fast tier
    "link_wait",  # synchronous copies behind background copies
    "sync_copy",  # synchronous copies (fetch, forced), and the steps' waits for them
    "fast_compute",  # experts computed on the fast tier
    "host_exposed",  # the host's experts (and reads), where the fast path did not hide them
    "read_drag",  # the fast tier's work slowed while the host reads over the link (the drags)
    "background_start",  # starting the idle background lane for a batch of copies
)


@dataclass(frozen=True)
class StreamTime:
    """The price of one stream (or of several pooled: `pool`)."""

    token_s: np.ndarray  # float64 (T,) seconds per token
    parts: dict[str, float]  # `BREAKDOWN` -> seconds over all tokens (sum: token_s.sum())
    hidden_host_s: float  # host seconds hidden behind the fast path (concurrent_host only)

    @property
    def time_per_token_s(self) -> float:
        return float(self.token_s.mean()) if len(self.token_s) else float("nan")


class LayerBlock(NamedTuple):
    """One token-layer's MoE block on the fast tier's clock (seconds from the stream's start)."""

    decided: float  # the decision: after the dense work, landings and installs
    fast_done: float  # the fast path's experts computed (synchronous copies before them)
    host_ready: float  # the host's experts read (the decision where it reads none over the link)
    end: float  # the layer's end: both paths done


def check_counts(counts: np.ndarray, delay: int) -> np.ndarray:
    """A stream's counts as int32 or int64 (T, L, len(TOKEN_LAYER_FIELDS)), else ValueError."""
    if isinstance(delay, bool) or not isinstance(delay, int | np.integer) or delay < 1:
        raise ValueError(f"delay={delay!r}: the policy's delay must be an integer >= 1")
    a = np.asarray(counts)
    F = len(TOKEN_LAYER_FIELDS)
    if a.ndim != 3 or a.shape[2] != F:
        raise ValueError(
            f"counts: expected shape (T, L, {F}) with fields {TOKEN_LAYER_FIELDS}, got {a.shape}"
        )
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"counts: expected an integer array, got {a.dtype}")
    if a.dtype not in (np.int32, np.int64):
        a = a.astype(np.int64)
    return np.ascontiguousarray(a)


def price_stream(counts: np.ndarray, delay: int, costs: UnitCosts) -> StreamTime:
    """One stream's counts (T, L, F) priced (the compiled core; negative counts: ValueError)."""
    a = check_counts(counts, delay)
    token_s = np.zeros(a.shape[0], np.float64)
    parts = np.zeros(len(BREAKDOWN) + 1, np.float64)  # + the hidden host seconds
    _core.price_stream(a, int(delay), _core_costs(costs), token_s, parts)
    return StreamTime(
        token_s, dict(zip(BREAKDOWN, parts[:-1].tolist(), strict=True)), float(parts[-1])
    )


def price_streams(streams: Sequence[np.ndarray], delay: int, costs: UnitCosts) -> StreamTime:
    """Every stream priced (each from an idle link), pooled."""
    return pool([price_stream(c, delay, costs) for c in streams])


def pool(times: Sequence[StreamTime]) -> StreamTime:
    """Streams' prices as one: tokens concatenated, parts summed."""
    if not times:
        raise ValueError("pool: no stream prices")
    return StreamTime(
        np.concatenate([s.token_s for s in times]),
        {p: float(sum(s.parts[p] for s in times)) for p in BREAKDOWN},
        float(sum(s.hidden_host_s for s in times)),
    )


def _core_costs(u: UnitCosts) -> tuple:
    return (u.copy_s, u.expert_s, u.host_expert_s, u.dense_layer_s, u.token_overhead_s,
            u.install_s, u.concurrent_host, u.host_reads_link, u.host_read_drag,
            u.background_read_drag, u.sync_step_s, u.host_read_each_s, u.host_step_s,
            u.background_start_s)  # fmt: skip


def _dragged_end(
    start: float, work: float, plain: float, windows: Sequence[tuple[float, float, float]]
) -> float:
    """The end of `work` seconds of the fast tier's work from `start` (`plain`: start + work as
    the caller added it), slowed by the fraction `drag` in each window `(a, b, drag)` (in time
    order, apart): `plain` where none slows it."""
    t, rest, slowed = start, work, False
    for a, b, drag in windows:
        if drag == 0.0 or a >= b or b <= t or t + rest <= a:
            continue
        if a > t:  # full speed up to the window
            rest -= a - t
            t = a
        fits = (b - t) / (1.0 + drag)  # the work the window holds
        slowed = True
        if rest <= fits:
            return t + rest * (1.0 + drag)
        rest -= fits
        t = b
    return t + rest if slowed else plain


def price_stream_reference(
    counts: np.ndarray, delay: int, costs: UnitCosts, blocks: list[LayerBlock] | None = None
) -> StreamTime:
    """`price_stream` in plain Python, step by step as the module docstring says (tests). With
    `blocks`, each token-layer's decision and ends are appended to it (`LayerBlock`, token-major:
    the timelines that benchmarks/host_path_phases.py holds the engine's blocks to)."""
    a = check_counts(counts, delay)
    negative = np.argwhere(a < 0)
    if len(negative):
        t, layer, _f = negative[0]
        raise ValueError(f"counts: negative count at token {t}, layer {layer}")
    T, L, _F = a.shape
    u = costs
    parts = dict.fromkeys(BREAKDOWN, 0.0)
    hidden_host = 0.0
    token_s = np.zeros(T, np.float64)
    clock = 0.0  # the fast tier's time
    link_free = 0.0  # when the link has carried every copy queued so far
    background_free = 0.0  # when it has carried every background copy queued so far
    host_drag = u.host_read_drag if u.host_reads_link else 0.0
    background_drag = u.background_read_drag if u.host_reads_link else 0.0

    def enqueue(at: float, n: int, each: float) -> float:
        """n reads of `each` seconds queued at time `at` behind those already queued: when the
        first starts."""
        nonlocal link_free
        start = max(at, link_free)
        link_free = start + n * each
        return start

    def background(at: float, n: int) -> tuple[float, float]:
        """n background copies queued at `at`: (when the first starts, the fast tier's seconds
        to start the lane: `background_start_s` where none was still on the link, else 0)."""
        nonlocal background_free
        started = u.background_start_s if n and background_free <= at else 0.0
        start = enqueue(at, n, u.copy_s)
        if n:
            background_free = link_free
        parts["background_start"] += started
        return start, started

    def work(start: float, seconds: float, part: str) -> float:
        """The fast tier's `seconds` of `part` from `start`: when they end, slowed while the link
        reads background copies (those queued so far run back to back from `start` until
        `link_free`; the host's reads are done by then)."""
        plain = start + seconds
        end = _dragged_end(start, seconds, plain, ((start, link_free, background_drag),))
        parts[part] += seconds
        parts["read_drag"] += end - plain
        return end

    # admission requests per layer and token modulo delay: (start on the link, copies); step 1
    # at token t reads those of token t - delay before step 5 overwrites them
    ring = min(delay, max(T, 1))
    requested = [[(0.0, 0)] * ring for _ in range(L)]
    prefetch_done = [0.0] * L  # when layer l's prefetch copies of this token have all landed
    for t in range(T):
        begin = clock
        clock = work(clock, u.token_overhead_s, "overhead")
        for layer in range(L):
            c = [int(x) for x in a[t, layer]]
            if layer == 0 and c[PREFETCHED]:
                start, started = background(clock, c[PREFETCHED])
                prefetch_done[0] = start + c[PREFETCHED] * u.copy_s
                clock += started
            clock = work(clock, u.dense_layer_s, "dense")
            nxt = int(a[t, layer + 1, PREFETCHED]) if layer + 1 < L else 0
            if nxt:
                start, started = background(clock, nxt)
                prefetch_done[layer + 1] = start + nxt * u.copy_s
                clock += started
            # step 1: landing admissions wait for their copies (the first ones requested), then
            # are installed
            slot = t % delay
            start, n = requested[layer][slot]
            landed = min(c[LANDED], n)
            if landed:
                ready = max(clock, start + landed * u.copy_s)
                parts["admit_wait"] += ready - clock
                clock = ready
            clock = work(clock, c[LANDED] * u.install_s, "install")
            # step 1b: prefetched experts wait for their copies, then are installed
            if c[PREFETCHED]:
                ready = max(clock, prefetch_done[layer])
                parts["prefetch_wait"] += ready - clock
                clock = ready
            clock = work(clock, c[PREFETCHED] * u.install_s, "install")
            # the decision: synchronous copies, then the host's reads where it reads over the
            # link, then the new background requests (the engine starts them once the host's
            # reads are done), on the link
            decided = clock
            n_sync = c[FETCH] + c[FORCED]
            sync_start = enqueue(decided, n_sync, u.copy_s) if n_sync else decided
            host_reads = c[HOST] if u.host_reads_link else 0
            reads = enqueue(decided, host_reads, u.host_read_each_s) if host_reads else 0.0
            start, started = background(decided, c[REQUESTS])
            requested[layer][slot] = (start, c[REQUESTS])
            # the fast path: the synchronous copies (and the step's wait for them), starting
            # the background lane for the requests, then the fast tier's experts
            n_fast = c[HIT] + c[FETCH] + c[SUB] + c[FORCED]
            copies = n_sync * u.copy_s + (u.sync_step_s if n_sync else 0.0)
            fast_end = sync_start + (copies + started + n_fast * u.expert_s)
            parts["link_wait"] += sync_start - decided
            parts["sync_copy"] += copies
            parts["fast_compute"] += n_fast * u.expert_s
            # the host path: its experts computed beside the fast path from the decision on, or
            # after it; read over the link, the reads queue behind every copy queued before and
            # the host computes once they are done (one processor: they overlap the fast path,
            # the host's compute follows)
            host = c[HOST] * u.host_expert_s + (u.host_step_s if c[HOST] else 0.0)
            ready = decided  # where the host reads nothing over the link: from the decision on
            if host_reads:
                ready = reads_end = reads + host_reads * u.host_read_each_s
            else:  # the background copies queued so far run to the link's end
                reads = reads_end = link_free
            # the fast tier's experts slowed while the link reads: the background copies queued
            # before, the host's reads, then this decision's background requests
            fast_start = sync_start + (copies + started)
            fast_done = _dragged_end(
                fast_start, n_fast * u.expert_s, fast_end,
                ((fast_start, reads, background_drag), (reads, reads_end, host_drag),
                 (reads_end, link_free, background_drag)),
            )  # fmt: skip
            parts["read_drag"] += fast_done - fast_end
            if u.concurrent_host:
                end = max(fast_done, ready + host)
                hidden_host += min(host, max(0.0, fast_done - ready))
                parts["host_exposed"] += end - fast_done
            else:  # on the one processor: slowed while the link reads this step's requests
                host_start = max(fast_done, ready)
                plain = host_start + host
                uploads = ((reads_end, link_free, background_drag),)
                end = _dragged_end(host_start, host, plain, uploads)
                parts["host_exposed"] += plain - fast_done
                parts["read_drag"] += end - plain
            if blocks is not None:
                blocks.append(LayerBlock(decided, fast_done, ready, end))
            clock = end
        token_s[t] = clock - begin
    return StreamTime(token_s, parts, hidden_host)
