"""Real-size, trace-driven engine benchmark (how the speed claims are measured without the model).

Experts of a real model's shapes (default Qwen3-Next-80B-A3B: H=2048, expert width 512, E=512,
top-10, bf16 = 6 MiB per expert) with random weights, for a configurable number of layers, are
driven by synthetic router decisions (`moesub.synthetic`) through the same engine as the model
decode loop (`OffloadEngine`: policy core, real synchronous copies, background admissions,
grouped compute from the slots). Per layer a real-size router matmul runs on the fast device and
its result is brought back to the host (the synchronization a real router imposes) before the
core decides from the synthetic logits; attention and the shared expert are not modelled.

Every policy runs in ONE process over the same trace from the same frequency-initial resident
set, one after the other; the output holds one row per policy with time per token and its
ratios to `fetch_every_miss` and `host_compute`, and the simulator's cost-model prediction
(calibrated in the same run) with its relative error.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from moesub.config import check_options, schema_defaults
from moesub.engine.calibrate import (
    cost_dict,
    measure_expert_compute,
    measure_host_compute,
    measure_link,
    predicted_time_per_token,
    timeit,
)
from moesub.engine.cuda_tier import CudaTier
from moesub.engine.host_memory import HostExperts
from moesub.engine.runtime import HostInputs, OffloadEngine
from moesub.engine.store import (
    StoreLayout,
    measure_read_bandwidth,
    open_or_write_store,
    random_experts,
)
from moesub.engine.tiers import DiskTier, require_cuda
from moesub.io import write_parquet
from moesub.params import options_from
from moesub.policy import ALL_RESIDENT, STUDY_POLICIES, Policy, capacity_for

# the benchmark's default policies: five of the study's, and the all-resident floor
_FROM_STUDY = ("fetch_every_miss", "host_compute", "rule_015", "quality", "speed")
BENCH_POLICIES: dict[str, dict[str, Any]] = {
    **{name: STUDY_POLICIES[name] for name in _FROM_STUDY},
    ALL_RESIDENT: {"rule": "fetch_all"},
}


_DEFAULTS = schema_defaults("engine.bench")  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class BenchParams:
    """The `engine_bench:` section of config.yaml (every key optional)."""

    # MoE layers simulated (each costs E * 6 MiB of disk / pinned memory)
    layers: int = _DEFAULTS["layers"]
    num_experts: int = _DEFAULTS["num_experts"]
    hidden: int = _DEFAULTS["hidden"]
    width: int = _DEFAULTS["width"]  # expert intermediate size I
    top_k: int = _DEFAULTS["top_k"]
    fraction: float = _DEFAULTS["fraction"]
    dtype: str = _DEFAULTS["dtype"]
    tokens: int = _DEFAULTS["tokens"]  # measured tokens per policy
    # tokens run before measuring (cache state evolves, time not recorded)
    warmup: int = _DEFAULTS["warmup"]
    rounds: int = 2  # every policy runs `rounds` times over the trace (order varied per round)
    # synthetic tokens the frequency-initial set is counted on
    calib_tokens: int = _DEFAULTS["calib_tokens"]
    seed: int = _DEFAULTS["seed"]
    # disk tier expert file (default: beside out_path)
    store_path: str | None = _DEFAULTS["store_path"]
    staging_buffers: int = _DEFAULTS["staging_buffers"]
    threads: int | None = None
    progress: bool = True
    policies: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(BENCH_POLICIES))

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> BenchParams:
        p = options_from(cls, params, "engine-bench")
        # `policies` here are policy dicts; in the config, a list of names (the workflow maps it)
        options = {k: v for k, v in (params or {}).items() if k != "policies"}
        check_options(options, "engine.bench", "engine-bench")
        for name in ("rounds", "threads"):  # the library-only options (not config keys)
            v = getattr(p, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"params.{name}={v!r} must be a positive integer")
        if p.capacity < p.top_k:
            raise ValueError(
                f"params.fraction={p.fraction} gives C={p.capacity} < top_k={p.top_k}: the cache "
                "is too small for k"
            )
        if not p.policies:
            raise ValueError("params.policies: at least one policy is required")
        for name, spec in p.policies.items():
            if name != ALL_RESIDENT:
                Policy.from_dict(dict(spec))
        return p

    @property
    def capacity(self) -> int:
        return capacity_for(self.fraction, self.num_experts)

    def layout(self) -> StoreLayout:
        return StoreLayout(
            num_layers=self.layers,
            num_experts=self.num_experts,
            hidden=self.hidden,
            width=self.width,
            dtype=self.dtype,
            fingerprint=f"random-seed{self.seed}",
        )


def frequency_initial(logits: np.ndarray, k: int, capacity: int) -> np.ndarray:
    """(L, C): per layer the C experts most often in the top-k of `logits` (T, L, E), ties to
    the lower id (the capture stage's frequency-initial rule)."""
    from moesub.artefacts import frequency_sets, topk_mask

    return frequency_sets(topk_mask(logits, k).sum(axis=0), capacity)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@dataclass
class _Run:
    wall_s: np.ndarray
    fetch_wait_s: np.ndarray
    bytes_sync: np.ndarray
    bytes_bg: np.ndarray
    counts: np.ndarray  # (T, 5)
    admissions: int
    syncs: np.ndarray  # (T,) host waits for the device per token
    admitted: int  # background copies installed
    admit_latency: int  # tokens from request to install, summed over those installed


@torch.inference_mode()
def _run_policy(
    engine: OffloadEngine,
    trace: np.ndarray,
    router_w: list[torch.Tensor],
    h0: torch.Tensor,
    warmup: int,
    desc: str,
    progress: bool,
) -> _Run:
    """Drive the engine over `trace` (T, L, E); the first `warmup` tokens are not recorded."""
    engine.reset()
    T, L, _E = trace.shape
    n = T - warmup
    wall, wait = np.zeros(n), np.zeros(n)
    bsync, bbg = np.zeros(n, np.int64), np.zeros(n, np.int64)
    counts = np.zeros((n, 5), np.int64)
    syncs = np.zeros(n, np.int64)
    admissions = admitted = admit_latency = 0
    for t in tqdm(range(T), desc=desc, unit="tok", disable=not progress, leave=False):
        t0 = time.perf_counter()
        engine.begin_token()
        hidden = h0  # (1, H) every token enters with the same hidden state
        for layer in range(L):
            x = _rms_norm(hidden)
            # the router on the fast device; its logits (and the input, for host_compute)
            # reach the host once before the core decides, as in the model adapter
            _z, x_host = engine.to_host(layer, (x @ router_w[layer].T).float(), x)
            s = engine.route(layer, trace[t, layer][None])
            slot, host_ids = engine.step_ids(s)
            w = engine.tier.upload(layer, s.weights, "weights").to(hidden.dtype)
            host = None
            if host_ids is not None:
                host = HostInputs(host_ids, x_host, torch.from_numpy(s.weights).to(x_host.dtype))
            y = engine.compute(layer, x, slot, w, host)
            hidden = hidden + y
        st = engine.end_token()  # waits for the compute stream
        dt = time.perf_counter() - t0
        if t >= warmup:
            i = t - warmup
            wall[i], wait[i] = dt, st.fetch_wait_s
            bsync[i], bbg[i] = st.bytes_sync, st.bytes_bg
            counts[i], syncs[i] = st.counts, st.syncs
            admissions += st.admissions
            admitted += st.admitted
            admit_latency += st.admit_latency
    if not torch.isfinite(hidden.float()).all():
        raise RuntimeError("benchmark hidden state became non-finite")
    return _Run(wall, wait, bsync, bbg, counts, admissions, syncs, admitted, admit_latency)


def _random_fill(lay: StoreLayout, seed: int, dev: torch.device):
    """`HostExperts` fill: a layer of random experts made on `dev`, written into its (pinned)
    host buffers 64 experts at a time."""

    def fill(layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        g = torch.Generator(device=dev).manual_seed(seed + layer)
        for host, fan_in in ((gate_up, lay.hidden), (down, lay.width)):
            for e in range(0, lay.num_experts, 64):
                shape = (min(64, lay.num_experts - e), *host.shape[1:])
                part = torch.randn(shape, generator=g, device=dev) * fan_in**-0.5
                host[e : e + shape[0]].copy_(part.to(lay.torch_dtype))

    return fill


def _concat_runs(runs: list[_Run]) -> _Run:
    return _Run(
        wall_s=np.concatenate([r.wall_s for r in runs]),
        fetch_wait_s=np.concatenate([r.fetch_wait_s for r in runs]),
        bytes_sync=np.concatenate([r.bytes_sync for r in runs]),
        bytes_bg=np.concatenate([r.bytes_bg for r in runs]),
        counts=np.concatenate([r.counts for r in runs]),
        admissions=sum(r.admissions for r in runs),
        syncs=np.concatenate([r.syncs for r in runs]),
        admitted=sum(r.admitted for r in runs),
        admit_latency=sum(r.admit_latency for r in runs),
    )


def _calibrate_bench(tier, store, trace, initial, router_w, h0, p: BenchParams, info) -> dict:
    """The simulator's cost-model figures measured on this tier (as `calibrate` does for a
    model). `dense_layer_s` is everything a layer costs besides expert compute and copies
    (router, norm, the policy core step, Python): measured on an all-hit pass over the trace
    restricted to the resident experts, minus k expert computations."""
    k, L = p.top_k, p.layers
    if isinstance(tier, DiskTier):
        bw = measure_read_bandwidth(store, reads=32, seed=p.seed)
        info.update(
            disk_read_bandwidth_Bps=bw.bytes_per_s, disk_read_latency_s=bw.latency_s,
            store_mode=bw.mode,
        )  # fmt: skip
    link_bw, link_lat = measure_link(tier, seed=p.seed)
    expert_s = measure_expert_compute(tier, k, seed=p.seed)
    host_s = measure_host_compute(tier, k, seed=p.seed)
    n = min(trace.shape[0], 48)
    hits_only = trace[:n].copy()  # (n, L, E): non-resident experts can never be selected
    for layer in range(L):
        mask = np.ones(p.num_experts, bool)
        mask[initial[layer]] = False
        hits_only[:, layer, mask] -= 1e4
    engine = OffloadEngine(
        tier, p.num_experts, k, initial.shape[1], Policy(rule="fetch_all"), initial, tier.act
    )
    run = _run_policy(engine, hits_only, router_w, h0, min(8, n // 2), "calibrate", False)
    if run.counts[:, 0].sum() != run.counts.sum():
        raise RuntimeError("calibration pass: expected only hits")
    raw_dense = _dense_layer_s(router_w[0], h0, tier.synchronize)
    dense = max(float(np.median(run.wall_s)) / L - k * expert_s, raw_dense)
    info.update(dense_layer_raw_s=raw_dense)
    return cost_dict(link_bw, link_lat, p.layout().expert_bytes, expert_s, host_s, dense)


def _dense_layer_s(router_w: torch.Tensor, h0: torch.Tensor, sync, reps: int = 20) -> float:
    def one() -> None:
        x = _rms_norm(h0)
        (x @ router_w.T).float().cpu()
        _ = h0 + x

    return timeit(one, sync, reps)


def run_benchmark(
    params: Mapping[str, Any] | None, device: str, out_path: str | os.PathLike
) -> pl.DataFrame:
    """Real-size engine benchmark on `device` ('cpu' = disk->RAM tier, 'cuda' = pinned->GPU).

    Writes one row per policy (`policy, device, tier, layers, tokens, time_per_token_median_s,
    time_per_token_p90_s, fetch_wait_s, bytes_sync, bytes_bg, hit_rate, sub_rate,
    speedup_vs_fetch_every_miss, speedup_vs_host_compute`, plus `time_per_token_mean_s,
    syncs_per_token, admit_latency_tokens, est_time_per_token_s, sim_rel_error`) to `out_path`
    atomically and returns the table. `fetch_wait_s`, `bytes_sync`, `bytes_bg` are means per
    token; `admit_latency_tokens` is the mean number of tokens from an admission's request to
    its install.
    """
    from moesub.synthetic import synthetic_logits

    p = BenchParams.from_dict(params)
    dev = require_cuda(device)
    if p.threads:
        torch.set_num_threads(p.threads)
    lay = p.layout()
    C, k, E, L = p.capacity, p.top_k, p.num_experts, p.layers
    out_path = Path(out_path)
    # memory checks before any work: slots (C) and, for all_resident, all E experts per layer
    need_ram = L * lay.expert_bytes * (E if ALL_RESIDENT in p.policies else C)
    if dev.type == "cuda":
        need_ram = L * E * lay.expert_bytes  # pinned host copy of every expert
    avail = _mem_available()
    if avail is not None and need_ram > 0.8 * avail:
        raise ValueError(
            f"params.layers={L}: the benchmark needs ~{need_ram / 2**30:.1f} GiB of host memory, "
            f"only {avail / 2**30:.1f} GiB available; use fewer layers"
        )
    store_path = Path(p.store_path) if p.store_path else out_path.parent / "bench_experts.bin"
    if dev.type == "cpu":
        store_path.parent.mkdir(parents=True, exist_ok=True)
        free = os.statvfs(store_path.parent)
        free_b = free.f_bavail * free.f_frsize
        have = store_path.stat().st_size if store_path.is_file() else 0
        if lay.file_bytes - have > 0.9 * free_b:
            raise ValueError(
                f"params.layers={L}: the expert file needs {lay.file_bytes / 2**30:.1f} GiB, "
                f"{free_b / 2**30:.1f} GiB free at {store_path.parent}"
            )
    store = None
    if dev.type == "cpu":
        store = open_or_write_store(
            store_path, lay, random_experts(lay, p.seed), progress=p.progress
        )

    g = torch.Generator().manual_seed(p.seed + 1)
    dt = lay.torch_dtype
    router_w = [
        (torch.randn(E, p.hidden, generator=g) * p.hidden**-0.5).to(device=dev, dtype=dt)
        for _ in range(L)
    ]
    h0 = torch.randn(1, p.hidden, generator=g).to(device=dev, dtype=dt)
    trace_all = synthetic_logits(p.calib_tokens + p.warmup + p.tokens, L, E, seed=p.seed)
    initial = frequency_initial(trace_all[: p.calib_tokens], k, C)
    trace = np.ascontiguousarray(trace_all[p.calib_tokens :])
    act = torch.nn.functional.silu
    host = None
    if dev.type == "cuda":  # random experts made on the GPU, kept in pinned host memory
        host = HostExperts(None, layout=lay, fill=_random_fill(lay, p.seed, dev))

    def make_tier(capacity: int):
        if dev.type == "cpu":
            return DiskTier(store, capacity, k, act, p.staging_buffers)
        return CudaTier(host, capacity, dev, act, p.staging_buffers)

    # policies in rounds; the order rotates every round and is reversed every other round, so
    # that drift in the machine's load does not favour a policy; one tier at a time (C slots per
    # layer, or E for all_resident)
    names = list(p.policies)
    order = []
    for r in range(p.rounds):
        rot = names[r % len(names) :] + names[: r % len(names)]
        order += rot if r % 2 == 0 else rot[::-1]
    info: dict[str, Any] = {}
    parts: dict[str, list[_Run]] = {n: [] for n in names}
    tier, tier_cap, cost, description, engine = None, 0, None, "", None
    try:
        for name in [None, *order]:  # None: the calibration pass, first
            cap = E if name == ALL_RESIDENT else C
            if tier is None or tier_cap != cap:
                if tier is not None:
                    tier.close()
                    tier = engine = None  # frees the slot buffers before allocating others
                    gc.collect()
                tier, tier_cap = make_tier(cap), cap
                description = description or tier.description
            if name is None:
                cost = _calibrate_bench(tier, store, trace, initial, router_w, h0, p, info)
                continue
            if name == ALL_RESIDENT:
                pol, init = Policy(rule="fetch_all"), np.tile(np.arange(E, dtype=np.int32), (L, 1))
            else:
                pol, init = Policy.from_dict(dict(p.policies[name])), initial
            engine = OffloadEngine(tier, E, k, cap, pol, init, act)
            parts[name].append(_run_policy(engine, trace, router_w, h0, p.warmup, name, p.progress))
    finally:
        if tier is not None:
            tier.close()
        if store is not None:
            store.close()
    runs = {n: _concat_runs(rs) for n, rs in parts.items()}

    rows = []
    for name, r in runs.items():
        slots = max(int(r.counts.sum()), 1)
        c = r.counts.sum(axis=0)
        counts = {
            "tokens": len(r.wall_s) * L,
            "hit": c[0], "fetch": c[1], "sub": c[2], "host": c[3], "forced": c[4],
            "admissions": r.admissions,
        }  # fmt: skip
        est = predicted_time_per_token(cost, counts, L)
        mean = float(r.wall_s.mean())
        rows.append(
            {
                "policy": name,
                "device": dev.type,
                "tier": tier_kind(dev),
                "layers": L,
                "tokens": len(r.wall_s),
                "time_per_token_median_s": float(np.median(r.wall_s)),
                "time_per_token_p90_s": float(np.percentile(r.wall_s, 90)),
                "time_per_token_mean_s": mean,
                "fetch_wait_s": float(r.fetch_wait_s.mean()),
                "bytes_sync": float(r.bytes_sync.mean()),
                "bytes_bg": float(r.bytes_bg.mean()),
                "hit_rate": float(c[0] / slots),
                "sub_rate": float(c[2] / slots),
                "syncs_per_token": float(r.syncs.mean()),
                "admit_latency_tokens": r.admit_latency / r.admitted if r.admitted else math.nan,
                "est_time_per_token_s": float(est),
                "sim_rel_error": float((est - mean) / mean),
            }
        )
    from moesub.metrics import speedup  # the project's one speedup

    out = pl.DataFrame(rows)
    med = dict(zip(out["policy"], out["time_per_token_median_s"], strict=True))
    for col, base in (("speedup_vs_fetch_every_miss", "fetch_every_miss"),
                      ("speedup_vs_host_compute", "host_compute")):  # fmt: skip
        times = out["time_per_token_median_s"].to_numpy()
        out = out.with_columns(
            pl.Series(col, speedup(med.get(base, np.nan), times), dtype=pl.Float64)
        )
    meta = {
        "device": str(dev),
        "tier": description,
        "params": asdict(p),
        "capacity": C,
        "expert_bytes": lay.expert_bytes,
        "cost_model": cost,
        "threads": torch.get_num_threads(),
        "note": "routed experts + real-size router only (no attention / shared expert); "
        "synthetic routing (moesub.synthetic); est_time_per_token_s = simulator cost model "
        "calibrated in this run, sim_rel_error = (est - measured mean) / measured mean",
        **info,
    }
    write_parquet(out, out_path, metadata=meta)
    return out


def tier_kind(dev: torch.device) -> str:
    return DiskTier.kind if dev.type == "cpu" else CudaTier.kind
