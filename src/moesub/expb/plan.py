"""The matched design before any model runs: feasibility on the calibration capture, and the plan
of which token-layers both conditions substitute on the evaluation streams.

Masses are per token-layer throughout: a token-layer's substituted mass is the sum of the
substituted experts' gate weights at that token and MoE layer (each token-layer's total is 1),
and a mean mass is averaged over *all* token-layers (substituted or not).

**Feasibility** (`feasibility_table`, over the captured calibration router logits): for each
candidate `heavy_mass`, the support (share of token-layers where `matched_masks` finds a heavy
expert and a light set) and the largest reachable target, `max_target` = the mean mass per
token-layer when every eligible token-layer is substituted (share p = 1; a token-layer counts
the mean of its heavy and light masses). The reachable range of m* is (0, max_target]; a
configured target outside it is an error (`check_targets`) raised before any emulation.

**Plan** (`matched_plan`). Eligibility and the experts to substitute are decided once, on the
exact model's captured router logits of the evaluation streams, and both conditions substitute
exactly those experts by id. Why not re-evaluate eligibility on each condition's live gate
weights during emulation: a substitution perturbs the hidden states of later layers and tokens,
differently in each condition, so live eligibility would pick different token-layers per
condition; a plan fixed before either condition runs makes the token-layer set identical by
construction. A planned expert that has left the live top-k, or become the live first choice,
is not substituted (counted as dropped); the realized mass is the live gate weight of what was
substituted, and the decision rule checks the realized masses.

The token-layers are chosen by one seeded hash of (stream, pos, layer), `u` uniform in [0, 1):
eligible token-layers with `u <= p`, where the share p is the smallest that makes the planned
mean mass per token-layer reach the target m* (so the sets for two targets are nested).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from moesub.artefacts import Trace
from moesub.expb.select import matched_masks
from moesub.policy import ALL_RESIDENT_POLICY, scan

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def gate_weights(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The policy core's gate weights and selection of a (T, L, E) float32 trace:
    (weights (T, L, k) float64, selected (T, L, k) int32), in rank order."""
    r = scan(logits, k, logits.shape[2], ALL_RESIDENT_POLICY)  # C = E
    return r.weights, r.selected


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def token_layer_hash(seed: int, stream: int, num_tokens: int, num_layers: int) -> np.ndarray:
    """u (T, L) float64 in [0, 1): a seeded hash of (stream, pos, layer) for one stream."""
    if isinstance(seed, bool) or int(seed) != seed or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    pos = np.arange(num_tokens, dtype=np.uint64)[:, None]
    layer = np.arange(num_layers, dtype=np.uint64)[None, :]
    x = _splitmix(np.full((1, 1), seed, dtype=np.uint64) + _GOLDEN)
    x = _splitmix(x ^ np.uint64(stream))
    x = _splitmix((x ^ pos) + _GOLDEN)
    x = _splitmix((x ^ layer) + _GOLDEN)  # (T, L)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _masses(weights: np.ndarray, heavy: np.ndarray, light: np.ndarray):
    """Per row (N,): heavy mass, light mass, their mean (the row's planned mass)."""
    m_h = np.where(heavy, weights, 0.0).sum(axis=1)
    m_l = np.where(light, weights, 0.0).sum(axis=1)
    return m_h, m_l, 0.5 * (m_h + m_l)


# --------------------------------------------------------------------------- feasibility
FEASIBILITY_GRID = tuple(round(0.04 + 0.02 * i, 2) for i in range(14))  # 0.04 .. 0.30


def feasibility_table(
    trace: Trace, heavy_masses: Iterable[float], configured: float | None = None
) -> pl.DataFrame:
    """One row per candidate heavy_mass over every token-layer of `trace` (the calibration
    capture): support, mean masses and ranks of the eligible token-layers, `max_target`."""
    k = trace.top_k
    w = np.concatenate([gate_weights(z, k)[0].reshape(-1, k) for z in trace.logits])  # (N, k)
    ranks = np.arange(1, k + 1, dtype=np.float64)
    masses = sorted(
        {float(m) for m in heavy_masses} | ({float(configured)} if configured else set())
    )
    rows = []
    for hm in masses:
        heavy, light = matched_masks(w, hm)
        ok = heavy.any(axis=1)
        m_h, m_l, m = _masses(w, heavy, light)
        n_ok = int(ok.sum())
        rows.append(
            {
                "heavy_mass": hm,
                "configured": bool(configured is not None and np.isclose(hm, configured)),
                "token_layers": int(w.shape[0]),
                "eligible": n_ok,
                "support": n_ok / w.shape[0],
                "max_target": float(m.sum() / w.shape[0]),
                "mean_heavy_weight": float(m_h[ok].mean()) if n_ok else None,
                "mean_light_weight": float(m_l[ok].mean()) if n_ok else None,
                "mean_light_count": float(light[ok].sum(axis=1).mean()) if n_ok else None,
                "mean_rank_heavy": float((heavy[ok] * ranks).sum() / n_ok) if n_ok else None,
                "mean_rank_light": float((light[ok] * ranks).sum() / light[ok].sum())
                if n_ok
                else None,
            }
        )
    return pl.DataFrame(rows)


def check_targets(
    table: pl.DataFrame, heavy_mass: float, targets: Sequence[float], key: str
) -> float:
    """Raise ValueError naming `key` and the reachable range when a target mass lies outside
    (0, max_target] for `heavy_mass`; returns max_target."""
    row = table.filter(np.isclose(table["heavy_mass"].to_numpy(), heavy_mass))
    if row.height != 1:
        raise ValueError(f"feasibility table has no row for heavy_mass {heavy_mass:g}")
    top, support = float(row["max_target"][0]), float(row["support"][0])
    bad = [m for m in targets if not 0 < m <= top]
    if bad:
        where = (
            f"no token-layer is eligible at heavy_mass {heavy_mass:g}"
            if support == 0
            else f"the reachable range of m* at heavy_mass {heavy_mass:g} is (0, {top:.4g}] "
            f"(support {100 * support:.1f}% of {int(row['token_layers'][0])} calibration "
            "token-layers)"
        )
        best = table.sort("max_target", descending=True).row(0, named=True)
        raise ValueError(
            f"{key}: target mass(es) {bad} (mean mass per token-layer) cannot be reached: "
            f"{where}; the largest reachable target is {best['max_target']:.4g} at heavy_mass "
            f"{best['heavy_mass']:g}"
        )
    return top


# --------------------------------------------------------------------------- the plan
@dataclass
class MatchedPlan:
    """Which experts each condition substitutes on the evaluation streams (planned on the
    captured exact logits). `ids[c][i]` (T, L, k) int32: the expert id planned for rank r at
    (pos, layer) of stream `streams[i]`, -1 where rank r is not substituted."""

    streams: list[int]
    ids: dict[str, list[np.ndarray]]
    share: float  # p: token-layers with hash u <= p among the eligible
    support: float  # eligible share of the evaluation token-layers
    planned_heavy: float  # mean planned mass per token-layer (captured weights)
    planned_light: float
    planned_token_layers: int


def matched_plan(trace: Trace, heavy_mass: float, target: float, seed: int) -> MatchedPlan:
    """The matched design's plan at target mass m* over every stream of `trace` (the
    evaluation capture): both conditions at the same token-layers (module docstring)."""
    k, L = trace.top_k, trace.num_layers
    parts = []  # per stream: weights, selected, heavy, light, u (rows = (pos, layer))
    for stream, z in zip(trace.streams, trace.logits, strict=True):
        w, sel = gate_weights(z, k)
        w, sel = w.reshape(-1, k), sel.reshape(-1, k)  # (T*L, k)
        heavy, light = matched_masks(w, heavy_mass)
        u = token_layer_hash(seed, stream, z.shape[0], L).reshape(-1)  # (T*L,)
        parts.append((w, sel, heavy, light, u))
    w_all = np.concatenate([p[0] for p in parts])
    heavy_all = np.concatenate([p[2] for p in parts])
    light_all = np.concatenate([p[3] for p in parts])
    u_all = np.concatenate([p[4] for p in parts])
    ok = heavy_all.any(axis=1)
    _, _, m = _masses(w_all, heavy_all, light_all)
    order = np.flatnonzero(ok)[np.argsort(u_all[ok], kind="stable")]
    cum = np.cumsum(m[order])
    need = target * w_all.shape[0]
    n_take = min(int(np.searchsorted(cum, need * (1 - 1e-12))) + 1, order.size)
    share = float(u_all[order[n_take - 1]]) if n_take and n_take < order.size else 1.0
    ids: dict[str, list[np.ndarray]] = {"heavy": [], "light": []}
    chosen = np.zeros(0, dtype=bool)
    for (_w, sel, heavy, light, u), z in zip(parts, trace.logits, strict=True):
        take = heavy.any(axis=1) & (u <= share)  # (T*L,)
        chosen = np.r_[chosen, take]
        for cond, mask in (("heavy", heavy), ("light", light)):
            planned = np.where(mask & take[:, None], sel, -1).astype(np.int32)
            ids[cond].append(planned.reshape(z.shape[0], L, k))
    m_h, m_l, _ = _masses(w_all, heavy_all & chosen[:, None], light_all & chosen[:, None])
    return MatchedPlan(
        streams=list(trace.streams),
        ids=ids,
        share=share,
        support=float(ok.mean()),
        planned_heavy=float(m_h.mean()),
        planned_light=float(m_l.mean()),
        planned_token_layers=int(chosen.sum()),
    )
