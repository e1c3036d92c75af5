"""Cost-model calibration: measure the running machine's link and compute costs.

Writes the JSON that `moesub.cost.CostModel.from_json` reads (exactly its fields). On the
disk->RAM tier the "link" is the disk read path (page cache bypassed) and
`host_expert_compute_s` includes the fresh disk read each host miss costs there; on CUDA the
link is pinned host -> GPU memory.

Two ways: `calibrate` (a model) times each term in isolation (microbenchmarks); the real-size
benchmark (`moesub.engine.bench`) fits the terms to timed engine runs (`fit_token_costs`:
least squares of every token's wall time on its counters, over calibration runs made for the
purpose on tokens the validation runs do not use) and splits the fitted constant with
microbenchmarks (`cost_from_fit`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moesub.cost import CostModel
from moesub.engine.adapter import EngineSetup, build_engine_model
from moesub.engine.cuda_tier import CudaTier
from moesub.engine.decode import step
from moesub.engine.kernels import expert_forward
from moesub.engine.spec import EngineParams
from moesub.engine.store import measure_read_bandwidth
from moesub.engine.tiers import DiskTier
from moesub.io import write_json

COST_KEYS = tuple(f.name for f in fields(CostModel))


def timeit(fn: Callable[[], Any], sync: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `reps` runs (after `warmup`), synchronized."""
    for _ in range(warmup):  # synchronized too: a run may reuse the last one's pinned buffers
        fn()
        sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_link(tier, samples: int = 16, seed: int = 0) -> tuple[float, float]:
    """(bytes/s for expert-sized copies slow -> fast tier, seconds of fixed cost per transfer)."""
    if isinstance(tier, DiskTier):
        bw = measure_read_bandwidth(tier.store, reads=samples, seed=seed)
        return bw.bytes_per_s, bw.latency_s
    if isinstance(tier, CudaTier):  # the tier's own synchronous fetch path (layer 0)
        E, C = tier.layout.num_experts, tier.slots[0].capacity
        rng = np.random.default_rng(seed)
        picks = rng.choice(E, size=min(samples, E), replace=False).tolist()
        pairs = [(e, i % C) for i, e in enumerate(picks)]
        t = timeit(lambda: tier.fetch(0, pairs), tier.synchronize, reps=3)
        tier.take_wait_s()  # drop the measurement's fetch events
        small_h = tier.alloc((4096,), torch.uint8)
        small_d = torch.empty(4096, dtype=torch.uint8, device=tier.device)
        lat = timeit(lambda: small_d.copy_(small_h, non_blocking=True), tier.synchronize, 20)
        return len(picks) * tier.expert_bytes / t, lat
    raise ValueError(f"unknown tier {type(tier).__name__}")


def measure_expert_compute(tier, k: int, reps: int = 10, seed: int = 0) -> float:
    """Seconds to compute one expert for one token from fast-tier slots (k at once, / k). Each
    run uses k other random slots, so weights come from memory as in decoding, not from cache."""
    s = tier.slots[0]
    if s.capacity < k:
        raise ValueError(f"capacity {s.capacity} < k={k}")
    g = torch.Generator().manual_seed(seed)
    H = s.gate_up.shape[-1]
    x = torch.randn(1, H, generator=g).to(device=s.gate_up.device, dtype=s.gate_up.dtype)
    rng = np.random.default_rng(seed)
    sets = [rng.choice(s.capacity, size=k, replace=False).reshape(1, k) for _ in range(reps + 2)]
    it = iter(sets)
    w = torch.full((1, k), 1.0 / k, device=x.device, dtype=x.dtype)

    def run() -> None:
        expert_forward(
            x, next(it), w, s.gate_up, s.down, tier.act, tier.path, lambda a: tier.upload(0, a)
        )

    t = timeit(run, tier.synchronize, reps)
    return t / k


def measure_host_compute(tier, k: int, reps: int = 5, seed: int = 0) -> float:
    """Seconds per host_compute miss (k misses of one token at once, / k); on the disk tier this
    includes the fresh uncached read of each missed expert."""
    lay = tier.layout
    E, H = lay.num_experts, lay.hidden
    rng = np.random.default_rng(seed)
    # the host's inputs are on the host already (the router's transfer brought them)
    x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32)).to(lay.torch_dtype)
    w = torch.full((1, k), 1.0 / k, dtype=x.dtype)
    sets = [rng.choice(E, size=k, replace=False).reshape(1, k) for _ in range(reps + 2)]
    it = iter(sets)
    t = timeit(lambda: tier.host_forward(0, x, next(it), w), tier.synchronize, reps)
    return t / k


@torch.inference_mode()
def time_dense_layer(setup: EngineSetup, tokens: int = 32, seed: int = 0) -> float:
    """Seconds per MoE layer of one decode step with the routed experts skipped (attention,
    router, shared expert, embeddings and head amortized over the layers)."""
    for m in setup.experts:
        m.engine = None
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.info.vocab_size, (tokens + 2,), generator=g).tolist()
    cache, times = None, []
    for i, tok in enumerate(ids):
        t0 = time.perf_counter()
        logits, cache = step(setup.model, tok, cache, setup.device)
        float(logits[0])  # synchronize
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) / setup.info.num_layers


def measure_install(tier, reps: int = 10) -> float:
    """Seconds to install one landed background copy on the fast tier (slot-to-slot copy of an
    expert; on the disk tier the staging buffer -> slot memcpy the main thread does)."""
    s = tier.slots[0]
    if s.capacity < 2:
        return 0.0

    def run() -> None:
        s.gate_up[0].copy_(s.gate_up[1])
        s.down[0].copy_(s.down[1])

    return timeit(run, tier.synchronize, reps)


def cost_dict(
    link_bandwidth_Bps: float,
    transfer_latency_s: float,
    expert_bytes: int,
    expert_compute_s: float,
    host_expert_compute_s: float,
    dense_layer_s: float,
    token_overhead_s: float = 0.0,
    background_overlap: float = 0.0,
    install_s: float = 0.0,
) -> dict[str, Any]:
    """The cost-model JSON (every `CostModel` field, checked by building one)."""
    d = {
        "link_bandwidth_Bps": float(link_bandwidth_Bps),
        "transfer_latency_s": float(transfer_latency_s),
        "expert_bytes": float(expert_bytes),
        "expert_compute_s": float(expert_compute_s),
        "host_expert_compute_s": float(host_expert_compute_s),
        "dense_layer_s": float(dense_layer_s),
        "token_overhead_s": float(token_overhead_s),
        "background_overlap": float(background_overlap),
        "install_s": float(install_s),
    }
    CostModel(**d)
    return d


def measure_tier_costs(tier, k: int, expert_bytes: int, dense_layer_s: float) -> dict[str, Any]:
    """All cost-model figures measurable on a tier in isolation (dense time given by the caller;
    background copies counted as not hidden: no overlap measured here)."""
    bw, lat = measure_link(tier)
    return cost_dict(
        bw,
        lat,
        expert_bytes,
        measure_expert_compute(tier, k),
        measure_host_compute(tier, k),
        dense_layer_s,
        install_s=measure_install(tier),
    )


# ------------------------------------------------------------------- fitted to engine runs
FIT_TERMS = ("constant", "sync_copies", "host", "background")


@dataclass(frozen=True)
class TokenCounts:
    """Timed tokens of engine runs: wall seconds and counters per token (all layers)."""

    wall_s: np.ndarray  # (n,)
    sync_copies: np.ndarray  # fetched + forced experts
    host: np.ndarray  # experts computed by the host
    background: np.ndarray  # background copies requested (admissions, prefetches)

    @classmethod
    def concat(cls, parts: Sequence[TokenCounts]) -> TokenCounts:
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)))

    def design(self) -> np.ndarray:
        """(n, 4) regressors in `FIT_TERMS` order."""
        n = len(self.wall_s)
        cols = (np.ones(n), self.sync_copies, self.host, self.background)
        return np.stack([np.asarray(c, float) for c in cols], axis=1)


def fit_token_costs(tokens: TokenCounts, cut: float = 6.0, rounds: int = 4) -> dict[str, Any]:
    """Least squares of per-token wall time on the counters, `FIT_TERMS` order: seconds per token
    (constant) and per synchronous copy, host-computed expert and background copy. Tokens whose
    residual is beyond `cut` robust standard deviations (another process took the CPU) are left
    out, iteratively. A term whose counter is always zero is fitted as 0. Returns the
    coefficients and the number of tokens kept."""
    X, y = tokens.design(), np.asarray(tokens.wall_s, float)
    if len(y) < len(FIT_TERMS):
        raise ValueError(f"cost fit: {len(y)} timed tokens, need at least {len(FIT_TERMS)}")
    used = np.flatnonzero(np.abs(X).sum(axis=0) > 0)
    keep = np.ones(len(y), bool)
    beta = np.zeros(X.shape[1])
    for _ in range(rounds):
        beta[used] = np.linalg.lstsq(X[keep][:, used], y[keep], rcond=None)[0]
        r = y - X @ beta
        mad = 1.4826 * np.median(np.abs(r[keep] - np.median(r[keep])))
        new = np.abs(r - np.median(r[keep])) <= cut * max(mad, 1e-12)
        if (new == keep).all():
            break
        keep = new
    return {**dict(zip(FIT_TERMS, beta.tolist(), strict=True)), "kept": int(keep.sum())}


def cost_from_fit(
    fit: dict[str, float],
    *,
    layers: int,
    k: int,
    expert_bytes: float,
    expert_compute_s: float,
    transfer_latency_s: float,
    install_s: float,
    one_layer_s: float | None,
    dense_floor_s: float = 0.0,
) -> dict[str, Any]:
    """The cost model that reproduces a fit (`fit_token_costs`) of `layers`-layer, top-`k` runs.

    The fitted constant is token overhead + layers x (dense + k x expert compute); it is split
    with `one_layer_s` (the same all-hit runs over one layer: the per-token part) and the
    microbenchmarked `expert_compute_s` (lowered if it would leave a layer less than
    `dense_floor_s`). A synchronous copy's fitted cost keeps the measured latency and gives the
    link bandwidth; a host expert replaces a fast-tier expert; a background copy costs the
    measured `install_s` plus the unhidden share of its link time (the overlap, clipped to
    [0, 1])."""
    const = fit["constant"]
    token = 0.0
    if one_layer_s is not None and layers > 1:
        per_layer = (const - one_layer_s) / (layers - 1)
        token = min(max(const - layers * per_layer, 0.0), const)
    per_layer = (const - token) / layers
    expert = min(expert_compute_s, max(per_layer - dense_floor_s, 0.0) / k)
    copy = fit["sync_copies"]
    if copy <= transfer_latency_s:
        raise ValueError(
            f"cost fit: a synchronous copy fitted at {copy * 1e6:.0f} us, not more than the "
            f"measured latency {transfer_latency_s * 1e6:.0f} us (too few copies timed?)"
        )
    bw = expert_bytes / (copy - transfer_latency_s)
    link = expert_bytes / bw
    overlap = 1.0 - (fit["background"] - install_s) / link
    return cost_dict(
        bw, transfer_latency_s, expert_bytes, expert, fit["host"] + expert,
        per_layer - k * expert, token, min(max(overlap, 0.0), 1.0), install_s,
    )  # fmt: skip


def predicted_time_per_token(cost: dict[str, Any], counts: dict[str, float], layers: int):
    """The simulator's cost-model estimate (`moesub.cost.CostModel.time_per_token`)."""
    return CostModel(**{k: cost[k] for k in COST_KEYS}).time_per_token(counts, layers)


def calibrate(
    model_dir: str | os.PathLike,
    device: str,
    out_json: str | os.PathLike,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measure link bandwidth, per-transfer latency, per-expert compute (fast tier and host),
    and dense time per layer for the model at `model_dir` on `device`; write the cost-model
    JSON to `out_json` (atomically) and return it.

    `params` (optional) are engine params (`store_path`, `dtype`, `staging_buffers`, ...).
    """
    opts = EngineParams.from_dict(params)
    setup = build_engine_model(model_dir, device, opts, capacity=None)
    try:
        k = setup.info.top_k
        dense = time_dense_layer(setup, tokens=opts.calibrate_tokens)
        cost = measure_tier_costs(setup.tier, k, setup.expert_bytes, dense)
    finally:
        setup.tier.close()
    write_json(cost, Path(out_json))
    return cost
