"""Real-size, trace-driven engine benchmark (how the speed claims are measured without the model).

Experts of a real model's shapes (default Qwen3-Next-80B-A3B: H=2048, expert width 512, E=512,
top-10, bf16 = 6 MiB per expert) with random weights, for a configurable number of layers, are
driven by a captured router trace mapped onto the benchmark's layers and experts, or by
synthetic router decisions (`moesub.engine.bench_routing`) through the same engine as the model
decode loop (`OffloadEngine`: policy core, real synchronous copies, background admissions,
grouped compute from the slots). Per layer a real-size router matmul runs on the fast device and
its result is brought back to the host (the synchronization a real router imposes) before the
core decides from the synthetic logits; attention and the shared expert are not modelled.

Every policy runs in ONE process over the same tokens from the same frequency-initial resident
set, in `rounds` interleaved with the cost model's calibration runs (other tokens, mechanism
policies: all hits, every miss fetched, host compute, background admissions), so that the
machine's load hits all alike; every run has a tier of its own, as an engine serving one policy
does (no thread state carried over from another policy's run). The cost model is fitted to the
calibration runs (`moesub.engine.calibrate.fit_token_costs`) and prices every policy's counters;
`sim_rel_error` compares it with the engine's time per token (the median over rounds of each
run's mean). The output holds one row per policy with time per token and its ratios to
`fetch_every_miss` and `host_compute`, and the simulator's prediction with its relative error.
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
from moesub.engine.bench_inputs import bench_logits, check_resources, frequency_initial, random_fill
from moesub.engine.calibrate import (
    TokenCounts,
    cost_from_fit,
    fit_token_costs,
    measure_expert_compute,
    measure_install,
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
# the cost model's calibration runs: one mechanism each (hits only are run separately)
CALIBRATION_POLICIES: dict[str, dict[str, Any]] = {
    "cal_fetch": {"rule": "fetch_all", "eviction": "lru"},
    "cal_host": {"rule": "host_compute", "eviction": "lru"},
    "cal_admit": {"rule": "first_choice", "eviction": "lfu", "beta": 0.5},
}
CAL_HITS, CAL_HITS_ONE_LAYER = "cal_hits", "cal_hits_1layer"


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
    # every policy runs `rounds` times over its tokens (order varied per round)
    rounds: int = _DEFAULTS["rounds"]
    routing: str = _DEFAULTS["routing"]  # "trace" (a capture, `trace_dir`) or "synthetic"
    trace_dir: str | None = None  # capture directory of the trace (routing="trace")
    # tokens the frequency-initial set is counted on
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
        v = p.threads  # a library-only option (not a config key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"params.threads={v!r} must be a positive integer")
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
        if p.routing == "trace" and not p.trace_dir:
            raise ValueError("params.routing='trace' needs params.trace_dir (a capture directory)")
        return p

    @property
    def calibration_tokens(self) -> int:
        """Measured tokens of each calibration run (half the validation runs', at least 64)."""
        return max(64, self.tokens // 2)

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
    admissions: np.ndarray  # (T,) admission requests per token
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
    layers: int | None = None,
) -> _Run:
    """Drive the engine over `trace` (T, L, E) (its first `layers` layers, default all); the
    first `warmup` tokens are not recorded."""
    engine.reset()
    T, L, _E = trace.shape
    L = layers or L
    n = T - warmup
    wall, wait = np.zeros(n), np.zeros(n)
    bsync, bbg = np.zeros(n, np.int64), np.zeros(n, np.int64)
    counts = np.zeros((n, 5), np.int64)
    syncs, admissions = np.zeros(n, np.int64), np.zeros(n, np.int64)
    admitted = admit_latency = 0
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
            admissions[i] = st.admissions
            admitted += st.admitted
            admit_latency += st.admit_latency
    if not torch.isfinite(hidden.float()).all():
        raise RuntimeError("benchmark hidden state became non-finite")
    return _Run(wall, wait, bsync, bbg, counts, admissions, syncs, admitted, admit_latency)


def _concat_runs(runs: list[_Run]) -> _Run:
    return _Run(
        wall_s=np.concatenate([r.wall_s for r in runs]),
        fetch_wait_s=np.concatenate([r.fetch_wait_s for r in runs]),
        bytes_sync=np.concatenate([r.bytes_sync for r in runs]),
        bytes_bg=np.concatenate([r.bytes_bg for r in runs]),
        counts=np.concatenate([r.counts for r in runs]),
        admissions=np.concatenate([r.admissions for r in runs]),
        syncs=np.concatenate([r.syncs for r in runs]),
        admitted=sum(r.admitted for r in runs),
        admit_latency=sum(r.admit_latency for r in runs),
    )


def _hits_only(logits: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """`logits` (T, L, E) with every expert outside the layer's resident set `initial` (L, C)
    pushed down so far that it is never selected: a fetch_all run is then all hits."""
    out = logits.copy()
    for layer in range(out.shape[1]):
        mask = np.ones(out.shape[2], bool)
        mask[initial[layer]] = False
        out[:, layer, mask] -= 1e4
    return out


def _token_counts(r: _Run) -> TokenCounts:
    c = r.counts  # hit, fetch, sub, host, forced
    return TokenCounts(r.wall_s, c[:, 1] + c[:, 4], c[:, 3], r.admissions)


def _microbenchmarks(tier, store, router_w, h0, p: BenchParams, info: dict) -> dict[str, float]:
    """The terms timed in isolation: link latency, expert compute, install, the router's part
    of a layer (the fit's constant is split with them, `cost_from_fit`)."""
    if isinstance(tier, DiskTier):
        bw = measure_read_bandwidth(store, reads=32, seed=p.seed)
        info.update(
            disk_read_bandwidth_Bps=bw.bytes_per_s, disk_read_latency_s=bw.latency_s,
            store_mode=bw.mode,
        )  # fmt: skip
    link_bw, link_lat = measure_link(tier, seed=p.seed)
    micro = {
        "link_bandwidth_Bps": link_bw,
        "transfer_latency_s": link_lat,
        "expert_compute_s": measure_expert_compute(tier, p.top_k, seed=p.seed),
        "install_s": measure_install(tier),
        "dense_layer_raw_s": _dense_layer_s(router_w[0], h0, tier.synchronize),
    }
    info["microbenchmarks"] = micro
    return micro


def _fit_cost(cal: dict[str, list[_Run]], micro: dict, p: BenchParams, info: dict) -> dict:
    """The cost model fitted to the calibration runs (`fit_token_costs`, `cost_from_fit`)."""
    runs = [_token_counts(r) for name in (CAL_HITS, *CALIBRATION_POLICIES) for r in cal[name]]
    fit = fit_token_costs(TokenCounts.concat(runs))
    one = cal[CAL_HITS_ONE_LAYER]
    one_layer_s = float(np.median([np.median(r.wall_s) for r in one])) if one else None
    info["cost_fit"] = {**fit, "one_layer_s": one_layer_s}
    return cost_from_fit(
        fit, layers=p.layers, k=p.top_k, expert_bytes=p.layout().expert_bytes,
        expert_compute_s=micro["expert_compute_s"],
        transfer_latency_s=micro["transfer_latency_s"], install_s=micro["install_s"],
        one_layer_s=one_layer_s, dense_floor_s=micro["dense_layer_raw_s"],
    )  # fmt: skip


def _dense_layer_s(router_w: torch.Tensor, h0: torch.Tensor, sync, reps: int = 20) -> float:
    def one() -> None:
        x = _rms_norm(h0)
        (x @ router_w.T).float().cpu()
        _ = h0 + x

    return timeit(one, sync, reps)


def _round_order(names: list[str], rounds: int) -> list[str]:
    """Every name once per round; the order rotates every round and is reversed every other
    round, so that drift in the machine's load does not favour one."""
    order = []
    for r in range(rounds):
        rot = names[r % len(names) :] + names[: r % len(names)]
        order += rot if r % 2 == 0 else rot[::-1]
    return order


def run_benchmark(
    params: Mapping[str, Any] | None, device: str, out_path: str | os.PathLike
) -> pl.DataFrame:
    """Real-size engine benchmark on `device` ('cpu' = disk->RAM tier, 'cuda' = pinned->GPU).

    Writes one row per policy (`policy, device, tier, layers, tokens, time_per_token_median_s,
    time_per_token_p90_s, fetch_wait_s, bytes_sync, bytes_bg, hit_rate, sub_rate,
    speedup_vs_fetch_every_miss, speedup_vs_host_compute`, plus `time_per_token_mean_s,
    time_per_token_run_median_s, syncs_per_token, admit_latency_tokens, est_time_per_token_s,
    sim_rel_error`) to `out_path` atomically and returns the table. `fetch_wait_s`,
    `bytes_sync`, `bytes_bg` are means per token; `admit_latency_tokens` is the mean number of
    tokens from an admission's request to its install; `time_per_token_run_median_s` is the
    median over rounds of each run's mean time per token, which `est_time_per_token_s` (the
    cost model fitted in this run, priced on the policy's counters) is compared with:
    `sim_rel_error = (est - run median) / run median`.
    """
    p = BenchParams.from_dict(params)
    dev = require_cuda(device)
    if p.threads:
        torch.set_num_threads(p.threads)
    lay = p.layout()
    C, k, E, L = p.capacity, p.top_k, p.num_experts, p.layers
    out_path = Path(out_path)
    store_path = check_resources(p, dev, out_path)
    logits = bench_logits(
        p.routing, L, E, p.calib_tokens, p.warmup + p.tokens, p.warmup + p.calibration_tokens,
        p.seed, p.trace_dir,
    )  # fmt: skip
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
    initial = frequency_initial(logits.initial, k, C)
    hits = _hits_only(logits.calibration, initial)
    act = torch.nn.functional.silu
    host = None
    if dev.type == "cuda":  # random experts made on the GPU, kept in pinned host memory
        host = HostExperts(None, layout=lay, fill=random_fill(lay, p.seed, dev))

    def make_tier(capacity: int):
        if dev.type == "cpu":
            return DiskTier(store, capacity, k, act, p.staging_buffers)
        return CudaTier(host, capacity, dev, act, p.staging_buffers)

    # the policies and the calibration runs in interleaved rounds, each run on a fresh tier (C
    # slots per layer, or E for all_resident): a run inherits no thread state from the one
    # before. Measured on the disk tier with one tier per capacity: once a host_compute run had
    # used the tier's host worker (which then keeps an OpenMP team of its own, more OpenMP
    # threads than cores, so libgomp throttles the spin-waits of the decode's worker: its CPU
    # time per token fell ~3x), every later run on that tier was ~2-3 ms per token slower, and
    # the cost model fitted to such runs overpredicted all_resident (a tier of its own) by 15%.
    cal_names = [CAL_HITS, *CALIBRATION_POLICIES] + ([CAL_HITS_ONE_LAYER] if L > 1 else [])
    order = _round_order(list(p.policies) + cal_names, p.rounds)
    info: dict[str, Any] = {"routing": logits.source, "load_avg_start": os.getloadavg()}
    parts: dict[str, list[_Run]] = {n: [] for n in [*p.policies, *cal_names, CAL_HITS_ONE_LAYER]}
    tier, description, engine, micro = None, "", None, None
    try:
        for name in order:
            cap = E if name == ALL_RESIDENT else C
            tier = make_tier(cap)
            description = description or tier.description
            if micro is None and cap == C:
                micro = _microbenchmarks(tier, store, router_w, h0, p, info)
            trace, init, layers, warmup = logits.validation, initial, None, p.warmup
            if name == ALL_RESIDENT:
                pol, init = Policy(rule="fetch_all"), np.tile(np.arange(E, dtype=np.int32), (L, 1))
            elif name in (CAL_HITS, CAL_HITS_ONE_LAYER):
                pol, trace = Policy(rule="fetch_all"), hits
                layers = 1 if name == CAL_HITS_ONE_LAYER else None
            elif name in CALIBRATION_POLICIES:
                pol, trace = Policy.from_dict(CALIBRATION_POLICIES[name]), logits.calibration
            else:
                pol = Policy.from_dict(dict(p.policies[name]))
            engine = OffloadEngine(tier, E, k, cap, pol, init, act)
            show = p.progress and not name.startswith("cal_")
            run = _run_policy(engine, trace, router_w, h0, warmup, name, show, layers)
            all_hits = run.counts[:, 0].sum() == run.counts.sum()
            if (layers is not None or trace is hits) and not all_hits:
                raise RuntimeError(f"calibration run {name}: expected only hits")
            parts[name].append(run)
            tier.close()
            tier = engine = None  # frees the slot buffers before the next run allocates its own
            gc.collect()
        if micro is None:  # every policy ran at C = E: time the terms on a C-slot tier
            tier = make_tier(C)
            micro = _microbenchmarks(tier, store, router_w, h0, p, info)
    finally:
        if tier is not None:
            tier.close()
        if store is not None:
            store.close()
    info["load_avg_end"] = os.getloadavg()
    cost = _fit_cost(parts, micro, p, info)
    runs = {n: _concat_runs(parts[n]) for n in p.policies}

    rows = []
    for name, r in runs.items():
        slots = max(int(r.counts.sum()), 1)
        c = r.counts.sum(axis=0)
        counts = {
            "tokens": len(r.wall_s) * L,
            "hit": c[0], "fetch": c[1], "sub": c[2], "host": c[3], "forced": c[4],
            "admissions": int(r.admissions.sum()),
        }  # fmt: skip
        est = predicted_time_per_token(cost, counts, L)
        mean = float(r.wall_s.mean())
        run_median = float(np.median([run.wall_s.mean() for run in parts[name]]))
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
                "time_per_token_run_median_s": run_median,
                "fetch_wait_s": float(r.fetch_wait_s.mean()),
                "bytes_sync": float(r.bytes_sync.mean()),
                "bytes_bg": float(r.bytes_bg.mean()),
                "hit_rate": float(c[0] / slots),
                "sub_rate": float(c[2] / slots),
                "syncs_per_token": float(r.syncs.mean()),
                "admit_latency_tokens": r.admit_latency / r.admitted if r.admitted else math.nan,
                "est_time_per_token_s": float(est),
                "sim_rel_error": float((est - run_median) / run_median),
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
        "est_time_per_token_s = the cost model fitted to this run's calibration runs (other "
        "tokens), sim_rel_error = (est - time_per_token_run_median_s) / the same",
        **info,
    }
    write_parquet(out, out_path, metadata=meta)
    return out


def tier_kind(dev: torch.device) -> str:
    return DiskTier.kind if dev.type == "cpu" else CudaTier.kind
