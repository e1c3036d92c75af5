"""The cache regime of a model: how its routing behaves under a partial expert cache.

Every figure the pipeline reports about substitution depends on the regime the model routes in:
how often `fetch_every_miss` already hits, how concentrated the routing is, how far apart a
token's experts are reused, how heavy the lower ranks' gate weights are. This module measures
those per MoE layer from a captured router trace (the evaluation streams) at one cache size
(the configured size nearest the study's 25% resident, or `regime.size`: `moesub.config.
regime_size`), the caches starting from the calibration capture's expert ranking, sets them
beside the reference figures the study gives, and states in one line how the model's regime
compares.

Per layer (and ``layer = -1`` for all layers together):

- ``hit_rate`` / ``belady_hit_rate``: `fetch_every_miss` (fetch_all + LRU) at capacity C and its
  offline optimum (Belady eviction), both replayed by the C++ policy core (`moesub.grid`);
- ``rule015_sub_rate``: share of expert calls the 0.15 rule (threshold 0.15 + LRU) substitutes;
- ``effective_experts``: exp of the entropy of the experts' top-k selection counts over the
  trace; below C, a C-slot cache can hold nearly every expert in use (collapse), and the hit
  rate says nothing about substitution. ``experts_used``: experts selected at least once;
- ``routing_entropy``: mean over tokens of the entropy (nats) of the full softmax over E;
- ``weight_rank<r>``: mean normalized gate weight of rank r (top-k renormalized, as
  docs/policy-semantics.md step 2);
  ``heavy_lower_ranks``: share of ranks 2..k with weight >= 0.15 (the misses the 0.15 rule
  always fetches);
- ``reuse_*``: distribution of the reuse distance of expert selections, the tokens since the
  same expert was last selected in the same stream and layer: shares of selections at distance
  1, 2-4, 5-16, 17-64, 65-256, > 256 tokens, and ``reuse_first`` (first selection in the
  stream). ``reuse_1`` of independent routing would be k / E.
- ``lookahead_recall_k`` / ``lookahead_recall_2k``: the prefetch predictor's recall, the share
  of a token's top-k experts found among the n largest lookahead logits (the layer's router one
  MoE layer earlier, docs/policy-semantics.md v2) for n = k and n = min(2k, E), ties to the
  lower id on both sides (`lookahead_recall`); null for a trace captured without lookahead.

The all-layers row (``layer = -1``) pools calls (hit rates), tokens (entropy, weights) and
selections (reuse); its ``effective_experts`` and ``experts_used`` are the smallest layer's,
the figure the collapse criterion reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from moesub.artefacts import has_lookahead, layout_for, load_trace, topk_mask
from moesub.grid import GridPoint, simulate
from moesub.io import write_json, write_parquet
from moesub.policy import STUDY_POLICIES, Policy, check_sizes

# Figures the study (or the public trace study it cites) gives, keyed by this module's column.
REFERENCES: dict[str, tuple[float, str]] = {
    "hit_rate": (
        0.915,
        "Qwen3-Next-80B-A3B, fetch_every_miss at 25% resident (the reference study)",
    ),
    "hit_rate_llamacpp": (
        0.81,
        "a 512-expert top-10 model replayed with LRU at 25% (public llama.cpp trace study)",
    ),
    "rule015_sub_rate": (
        0.075,
        "Qwen3-Next-80B-A3B, share of expert calls the 0.15 rule substituted (the reference study)",
    ),
}
REUSE_EDGES = (1, 4, 16, 64, 256)  # upper bounds of the reuse-distance bins (tokens)
REUSE_COLUMNS = ("reuse_1", "reuse_2_4", "reuse_5_16", "reuse_17_64", "reuse_65_256")
HEAVY_WEIGHT = STUDY_POLICIES["rule_015"]["tau"]  # the 0.15 rule's threshold
# a hit rate within this of the reference model's counts as "comparable"
COMPARABLE_MARGIN = 0.03


@dataclass(frozen=True)
class Regime:
    """Per-layer regime table (`layers`, one row per layer + layer -1) and its summary."""

    layers: pl.DataFrame
    summary: dict[str, Any]


def effective_experts(counts: np.ndarray) -> np.ndarray:
    """exp(entropy) of selection counts (..., E) -> (...): E for uniform use, 1 for one expert."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    if (total <= 0).any():
        raise ValueError("counts: every row needs at least one selection")
    p = counts / total
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return np.exp(-plogp.sum(axis=-1))


def reuse_distances(selected: np.ndarray) -> tuple[np.ndarray, int]:
    """Token distances between consecutive selections of the same expert in one stream-layer.

    `selected` is a (T, E) bool mask of each token's top-k. Returns the distances (int64, one
    per selection that is not the expert's first in the stream) and the number of first
    selections.
    """
    experts, tokens = np.nonzero(selected.T)  # sorted by expert, then token
    same = experts[1:] == experts[:-1]
    distances = (tokens[1:] - tokens[:-1])[same]
    return distances.astype(np.int64), int(len(tokens) - same.sum())


def gate_weights_by_rank(logits: np.ndarray, k: int) -> np.ndarray:
    """(..., E) float32 logits -> (..., k) normalized gate weights of the top-k, rank order."""
    E = logits.shape[-1]
    top = np.partition(logits, E - k, axis=-1)[..., E - k :].astype(np.float64)  # (..., k)
    top = -np.sort(-top, axis=-1)
    w = np.exp(top - top[..., :1])
    return w / w.sum(axis=-1, keepdims=True)


def softmax_entropy(logits: np.ndarray) -> np.ndarray:
    """(..., E) logits -> (...) entropy in nats of softmax(logits), computed in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return -plogp.sum(axis=-1)


def _routing_stats(streams: list[np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Per-layer routing statistics that need no cache replay; each value is (L,) or (L, n)."""
    L, E = streams[0].shape[1:]
    entropy_sum = np.zeros(L)
    weight_sum = np.zeros((L, k))
    heavy = np.zeros(L)
    reuse_hist = np.zeros((L, len(REUSE_EDGES) + 1), dtype=np.int64)  # bins + "> last edge"
    first = np.zeros(L, dtype=np.int64)
    counts = np.zeros((L, E), dtype=np.int64)
    tokens = 0
    bins = np.asarray(REUSE_EDGES)
    for z in streams:  # (T, L, E)
        tokens += z.shape[0]
        mask = topk_mask(z, k)  # (T, L, E)
        counts += mask.sum(axis=0)
        for layer in range(L):
            zl = z[:, layer]  # (T, E)
            entropy_sum[layer] += softmax_entropy(zl).sum()
            w = gate_weights_by_rank(zl, k)  # (T, k)
            weight_sum[layer] += w.sum(axis=0)
            heavy[layer] += (w[:, 1:] >= HEAVY_WEIGHT).sum()
            dist, n_first = reuse_distances(mask[:, layer])
            reuse_hist[layer] += np.bincount(
                np.searchsorted(bins, dist, side="left"), minlength=len(bins) + 1
            )
            first[layer] += n_first
    return {
        "counts": counts,
        "routing_entropy": entropy_sum / tokens,
        "weights": weight_sum / tokens,
        "heavy_lower_ranks": heavy / (tokens * max(k - 1, 1)),
        "reuse_hist": reuse_hist,
        "reuse_first": first,
    }


def lookahead_recall(
    streams: list[np.ndarray], lookahead: list[np.ndarray], k: int, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Prefetch predictor recall per layer: (found, total) int64 (L,) each, `found` the token
    top-k experts (router logits) that are among the `n` largest lookahead logits, `total` the
    top-k selections (k per token); ties to the lower id on both sides (v1 selection)."""
    if len(streams) != len(lookahead):
        raise ValueError(f"lookahead: {len(lookahead)} streams for {len(streams)} logit streams")
    L, E = streams[0].shape[1:]
    if not 1 <= n <= E:
        raise ValueError(f"n: must be in [1, E={E}], got {n}")
    found = np.zeros(L, np.int64)
    tokens = 0
    for z, y in zip(streams, lookahead, strict=True):
        if y.shape != z.shape:
            raise ValueError(f"lookahead: shape {y.shape} differs from the logits' {z.shape}")
        found += (topk_mask(z, k) & topk_mask(y, n)).sum(axis=(0, 2))
        tokens += z.shape[0]
    return found, np.full(L, tokens * k, np.int64)


def measure_regime(
    streams: list[np.ndarray],
    k: int,
    capacity: int,
    initial: np.ndarray | None,
    lookahead: list[np.ndarray] | None = None,
) -> Regime:
    """The regime of a trace: `streams` float32 (T, L, E) each (caches restart per stream);
    `initial` the (L, C) initial resident set (None: experts 0..C-1); `lookahead` the trace's
    lookahead logits (None: the recall columns are null)."""
    if not streams:
        raise ValueError("streams: need at least one router-logit stream")
    L, E = streams[0].shape[1:]
    check_sizes(E, k, capacity)
    grid = [
        GridPoint(name, Policy.from_dict(STUDY_POLICIES[name]), capacity, initial)
        for name in ("fetch_every_miss", "rule_015")
    ]
    sim = simulate(streams, k, grid, n_threads=1)
    fem = sim.filter(pl.col("policy") == "fetch_every_miss")
    r015 = sim.filter(pl.col("policy") == "rule_015")
    stats = _routing_stats(streams, k)
    counts = stats["counts"]  # (L, E)
    tokens = sum(z.shape[0] for z in streams)

    eff = effective_experts(counts)  # (L,)
    recall = {
        f"lookahead_recall_{name}": None
        if lookahead is None
        else lookahead_recall(streams, lookahead, k, min(n, E))
        for name, n in (("k", k), ("2k", 2 * k))
    }

    def rows_for(layers: list[int]) -> dict[str, Any]:
        hist = stats["reuse_hist"][layers].sum(axis=0)
        n_sel = hist.sum() + stats["reuse_first"][layers].sum()
        row: dict[str, Any] = {
            "effective_experts": float(eff[layers].min()),
            "experts_used": int((counts[layers] > 0).sum(axis=1).min()),
            "routing_entropy": float(stats["routing_entropy"][layers].mean()),
            "heavy_lower_ranks": float(stats["heavy_lower_ranks"][layers].mean()),
        }
        for r in range(k):
            row[f"weight_rank{r + 1}"] = float(stats["weights"][layers, r].mean())
        for name, n in zip(REUSE_COLUMNS, hist[:-1], strict=True):
            row[name] = float(n / n_sel)
        row[f"reuse_gt_{REUSE_EDGES[-1]}"] = float(hist[-1] / n_sel)
        row["reuse_first"] = float(stats["reuse_first"][layers].sum() / n_sel)
        for name, r in recall.items():  # pooled over the layers' selections
            row[name] = None if r is None else float(r[0][layers].sum() / r[1][layers].sum())
        return row

    rows = []
    for layer in [*range(L), -1]:
        f_row = fem.filter(pl.col("layer") == layer).row(0, named=True)
        r_row = r015.filter(pl.col("layer") == layer).row(0, named=True)
        rows.append(
            {
                "layer": layer,
                "tokens": tokens,
                "capacity": capacity,
                "hit_rate": f_row["hit_rate"],
                "belady_hit_rate": f_row["belady_hit_rate"],
                "rule015_sub_rate": r_row["sub_rate"],
                **rows_for([layer] if layer >= 0 else list(range(L))),
            }
        )
    table = pl.DataFrame(rows, schema_overrides={name: pl.Float64 for name in recall})
    summary = summarize(table, k, E)
    return Regime(layers=table, summary=summary)


def summarize(table: pl.DataFrame, k: int, num_experts: int) -> dict[str, Any]:
    """Headline figures, the reference figures beside them, and the one-line verdict."""
    total = table.filter(pl.col("layer") == -1).row(0, named=True)
    per_layer = table.filter(pl.col("layer") >= 0).sort("layer")
    capacity = int(total["capacity"])
    min_eff = float(per_layer["effective_experts"].min())
    summary: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": k,
        "capacity": capacity,
        "tokens": int(total["tokens"]),
        "hit_rate": total["hit_rate"],
        "belady_hit_rate": total["belady_hit_rate"],
        "rule015_sub_rate": total["rule015_sub_rate"],
        "heavy_lower_ranks": total["heavy_lower_ranks"],
        "min_effective_experts": min_eff,
        "collapsed": min_eff < capacity,
        "lookahead_recall_k": total.get("lookahead_recall_k"),
        "lookahead_recall_2k": total.get("lookahead_recall_2k"),
        "references": {name: {"value": v, "source": s} for name, (v, s) in REFERENCES.items()},
        "layers": per_layer.select(
            "layer", "hit_rate", "belady_hit_rate", "effective_experts", "experts_used"
        ).to_dicts(),
    }
    summary["verdict"] = verdict(summary)
    return summary


def verdict(summary: dict[str, Any]) -> str:
    """One line: where the model's fetch_every_miss hit rate sits between the references."""
    hit, cap = summary["hit_rate"], summary["capacity"]
    ref, llama = REFERENCES["hit_rate"][0], REFERENCES["hit_rate_llamacpp"][0]
    fraction = cap / summary["num_experts"]
    if summary["collapsed"]:
        return (
            f"collapsed routing: a layer uses only {summary['min_effective_experts']:.0f} "
            f"effective experts (< C = {cap}), so the {hit:.3f} hit rate at {fraction:.0%} "
            "resident reflects a cache that holds nearly every expert in use, not the reference "
            "regime"
        )
    if hit >= ref - COMPARABLE_MARGIN:
        where = f"comparable to the reference model's ({ref})"
    elif hit >= llama:
        where = f"between the llama.cpp trace study's ({llama}) and the reference model's ({ref})"
    else:
        where = (
            f"below both the reference model's ({ref}) and the llama.cpp trace study's ({llama}):"
            " misses are more frequent, so substitution figures overstate the reference's"
        )
    return (
        f"fetch_every_miss hits {hit:.3f} at {fraction:.0%} resident (C = {cap}), {where}; "
        f"no collapse (every layer >= {summary['min_effective_experts']:.0f} effective experts)"
    )


def regime_from_files(
    router_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    size: float | dict[str, Any],
) -> Regime:
    """The regime of a captured trace at a cache `size` (a resolved size or a fraction), the
    caches starting from the prefixes of the expert ranking at `ranking_path`."""
    trace = load_trace(router_path, lookahead=has_lookahead(router_path))
    E, k, L = trace.num_experts, trace.top_k, trace.num_layers
    layout = layout_for(ranking_path, size, STUDY_POLICIES["fetch_every_miss"], k, L, E)
    capacity = layout.size.capacity
    regime = measure_regime(trace.logits, k, capacity, layout.initial_array(), trace.lookahead)
    regime.summary["fraction"] = layout.size.fraction
    regime.summary["size"] = layout.size.to_dict()
    regime.summary["model"] = trace.meta.get("model")
    return regime


def run_regime(
    router_path: str,
    ranking_path: str,
    size: float | dict[str, Any],
    out_table: str | os.PathLike,
    out_summary: str | os.PathLike,
) -> None:
    """Snakemake entry point: per-layer regime table (Parquet) + summary with verdict (JSON)."""
    regime = regime_from_files(router_path, ranking_path, size)
    write_parquet(regime.layers, out_table, metadata={"summary": regime.summary})
    write_json(regime.summary, Path(out_summary))
