"""The skew-matched trace: a router trace whose pooled expert popularity per layer follows given
target shares (the real reference model's, `moesub.skew.target_shares`), with each stream's own
routing kept.

Method. Every stream s and layer l gets one relabelling of expert ids, a permutation π_{s,l} of
0..E-1, applied to all its tokens: the logit of expert e becomes the logit of id π_{s,l}(e), for
the router logits and the lookahead logits alike. Within a stream nothing changes but the names:
every token's logits are the same values (so its top-k, gate weights, ranks, entropy), and every
reuse (which tokens select the same expert, at which distance) is the same. Across streams the
same id now names different experts, which is what changes the pooled popularity: a static
expert set (an initial set, a pin list) sees the target skew, while a cache that adapts within a
stream sees the stream's own locality, as before. Caches restart per stream, so within-stream
behaviour is exactly the original trace's.

The permutations are chosen so that the pooled selection counts per id come as close as they can
(least squares) to the target counts: id i's target is the target share of its rank in the
original pooled ranking (most selected first, ties to the lower id), times the layer's
selections, so the hot ids stay hot (an initial set or pin list drawn from the same ranking
keeps its meaning) with the target's shares. Coordinate descent: each stream in turn takes the
permutation that minimizes the squared distance of the pooled counts to the target given the
other streams' permutations; by the rearrangement inequality that pairs its experts sorted by
count with the ids sorted by remaining need (target minus the other streams' counts). Sweeps over
the streams repeat until no permutation changes (at most `MAX_SWEEPS`); ties in either order are
broken by seeded random keys, drawn once per stream and layer.

Limits: how close the pooled counts get depends on the streams (a few streams, or streams that
each use few experts, cannot spread a hot expert over many ids); what happens within a stream
(its locality, how concentrated its routing is) is the original model's, not the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moesub.artefacts import frequency_sets, topk_mask

MAX_SWEEPS = 32


@dataclass(frozen=True)
class SkewMatched:
    """`logits` (and `lookahead`, None if the source had none): per stream (T, L, E) float32;
    `relabel` (S, L, E) int32, the id of expert e in stream s, layer l; `target` (L, E) float64,
    the pooled selections per id the match aimed at; `counts` (L, E) int64, those it reached;
    `stream_counts` (S, L, E) int64, each source stream's selections per expert (the matched
    stream's are the same under its ids)."""

    logits: list[np.ndarray]
    lookahead: list[np.ndarray] | None
    relabel: np.ndarray
    target: np.ndarray
    counts: np.ndarray
    stream_counts: np.ndarray


def match_counts(
    counts: np.ndarray, target: np.ndarray, rng: np.random.Generator, max_sweeps: int = MAX_SWEEPS
) -> np.ndarray:
    """(S, E) int per-stream selection counts and (E,) target pooled counts -> (S, E) int32
    relabelling: row s maps expert e to its id; the pooled counts of the ids,
    sum_s counts[s, e] at id relabel[s, e], are a least-squares local optimum (module docs)."""
    S, E = counts.shape
    if target.shape != (E,):
        raise ValueError(f"target: shape {target.shape}, expected ({E},)")
    relabel = np.full((S, E), -1, np.int32)
    pooled = np.zeros(E)  # selections per id of the streams placed so far
    expert_keys, id_keys = rng.random((S, E)), rng.random((S, E))  # tie-breaks, fixed per stream
    for _ in range(max_sweeps):
        changed = False
        for s in range(S):
            c = counts[s]
            if relabel[s, 0] >= 0:
                pooled[relabel[s]] -= c
            experts = np.lexsort((expert_keys[s], -c))  # most selected first
            ids = np.lexsort((id_keys[s], -(target - pooled)))  # most needed first
            row = np.empty(E, np.int32)
            row[experts] = ids
            changed |= not np.array_equal(row, relabel[s])
            relabel[s] = row
            pooled[row] += c
        if not changed:
            break
    return relabel


def relabel_stream(z: np.ndarray, relabel: np.ndarray) -> np.ndarray:
    """(T, L, E) logits, (L, E) relabelling -> (T, L, E): out[:, l, relabel[l, e]] = z[:, l, e]."""
    out = np.empty_like(z)
    for layer, ids in enumerate(relabel):
        out[:, layer, ids] = z[:, layer]
    return out


def skew_match(
    streams: Sequence[np.ndarray],
    k: int,
    shares: np.ndarray,
    seed: int = 0,
    lookahead: Sequence[np.ndarray] | None = None,
) -> SkewMatched:
    """The skew-matched trace of `streams` ((T, L, E) float32 each) for top-k routing, aiming at
    `shares` ((L, E) per-layer target shares, hottest first); deterministic in `seed`."""
    if not streams:
        raise ValueError("streams: need at least one router-logit stream")
    L, E = streams[0].shape[1:]
    if shares.shape != (L, E):
        raise ValueError(f"shares: shape {shares.shape}, expected (L, E) = ({L}, {E})")
    if (shares < 0).any() or not np.allclose(shares.sum(axis=1), 1.0):
        raise ValueError("shares: every layer's shares must be >= 0 and sum to 1")
    if lookahead is not None and len(lookahead) != len(streams):
        raise ValueError(f"lookahead: {len(lookahead)} streams for {len(streams)} logit streams")
    counts = np.stack([topk_mask(z, k).sum(axis=0) for z in streams])  # (S, L, E)
    pooled = counts.sum(axis=0)  # (L, E)
    ranking = frequency_sets(pooled, E)  # (L, E) ids, most selected first
    target = np.empty((L, E))
    target[np.arange(L)[:, None], ranking] = shares * pooled.sum(axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    relabel = np.stack(
        [match_counts(counts[:, layer], target[layer], rng) for layer in range(L)], axis=1
    )  # (S, L, E)
    reached = np.zeros((L, E), np.int64)
    for s in range(len(streams)):
        for layer in range(L):
            reached[layer, relabel[s, layer]] += counts[s, layer]
    return SkewMatched(
        logits=[relabel_stream(z, r) for z, r in zip(streams, relabel, strict=True)],
        lookahead=None
        if lookahead is None
        else [relabel_stream(y, r) for y, r in zip(lookahead, relabel, strict=True)],
        relabel=relabel,
        target=target,
        counts=reached,
        stream_counts=counts,
    )
