"""Real-size, trace-driven engine benchmark (how the speed claims are measured without the model).

Experts of a real model's shapes (default Qwen3-Next-80B-A3B: H=2048, expert width 512, E=512,
top-10, bf16 = 6 MiB per expert) with random weights, for a configurable number of layers, are
driven by a captured router trace mapped onto the benchmark's layers and experts, or by
synthetic router decisions (`moesub.engine.bench_inputs`) through the same engine as the model
decode loop (`OffloadEngine`: policy core, real synchronous copies, background admissions,
grouped compute from the slots). Per layer a real-size router matmul runs on the fast device and
its result is brought back to the host (the synchronization a real router imposes) before the
core decides from the synthetic logits; attention and the shared expert are not modelled.

Every policy runs in ONE process over the same tokens from the same frequency-initial resident set,
in `rounds` with the calibration runs (other tokens, mechanism policies: all hits, over all layers
and over one, every miss fetched, host compute, background admissions) spread among them (`spread`)
and the order rotated every round (`round_order`: no run twice in a row). Each round runs every
run's next share of its measured tokens (`round_part`), after the `warmup` tokens before that
share, run unrecorded: many short rounds give every policy and the calibration the same stretches
of a machine whose speed drifts by a fifth within minutes (as the engine stage's rounds do). Every
run has a tier of its own, as an engine serving one policy does (no thread state carried over from
another policy's run), its slots loaded, untimed, from the initial set read once into RAM
(`SlotImage`); all_resident keeps its engine across its rounds (its slots, every expert, never
change; on the disk tier loading them read 4.5 GiB from the file a round). The machine's
profile is fitted to the calibration runs (`moesub.calibration`, as the pipeline's calibration
does) and prices every policy's own per-token-layer counts, round by round (`moesub.pricing`);
`sim_rel_error` compares their priced mean over all its tokens with their measured mean.
`sim_rel_error_at_run_disk` does the same with each run's copies priced at the disk's speed while
that run read (`at_run_disk`: its reads' time per expert, `disk_read_s`): the pricing's arithmetic
apart from the disk's drift between runs; `sim_rel_error_at_run_speed` also with a policy's
compute at the machine's speed while its rounds ran (`run_speed`, one for all of them), probed
on its own tokens that only hit (`moesub.run_speed.priced_at_speed`). One row per policy
(`bench_runs.policy_row`): time per token, its ratios to `fetch_every_miss` and `host_compute`,
the pricing's prediction and error, the runs' CPU share and the cores others used beside them
(`contended`: `moesub.engine.contention`), the disk's speed against the calibration's reference
copy run (`disk_vs_calibration`; `disk_drifted` beyond 15%: the drift alone can move a
copy-heavy policy's time by the 10% its price is held to; the host's reads, beside the slots'
compute, may also read slower than copies by their kind), the rounds' spread (`round_spread`: each
round's time over its price, max - min over their median). Beside it (`counts_path`) every
run's per-token-layer counts in `TOKEN_LAYER_FIELDS` layout with each token's wall time
(`bench_runs.counts_frame`, read back by `read_bench_counts`), validation and calibration runs
alike, one run per round. Policy v3 runs as everywhere.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from moesub.config import check_options, schema_defaults
from moesub.engine.bench_inputs import (
    BenchLogits,
    bench_logits,
    check_resources,
    frequency_initial,
    random_fill,
)
from moesub.engine.bench_runs import (
    BenchRun,
    at_run_disk,
    by_status,
    counts_path_for,
    fit_bench_costs,
    hits_only,
    policy_row,
    refit_without_each_round,
    round_part,
    run_policy,
    write_bench_counts,
)
from moesub.engine.calibrate import MECHANISMS, round_order, spread
from moesub.engine.cuda_tier import CudaTier
from moesub.engine.host_memory import HostExperts
from moesub.engine.microbench import microbenchmarks
from moesub.engine.runtime import OffloadEngine
from moesub.engine.store import (
    ExpertStore,
    StoreLayout,
    measure_read_bandwidth,
    open_or_write_store,
    random_experts,
)
from moesub.engine.tiers import DiskTier, SlotBuffers, SlotImage, require_cuda
from moesub.hardware import UnitCosts
from moesub.io import write_parquet
from moesub.layout import build_layout
from moesub.params import options_from
from moesub.policy import (
    ALL_RESIDENT,
    ALL_RESIDENT_POLICY,
    STUDY_POLICIES,
    Policy,
    check_capacity,
)
from moesub.run_speed import DiskClock
from moesub.slots import layer_pin, policy_fields

# the benchmark's default policies: five of the study's, and the all-resident floor
_FROM_STUDY = ("fetch_every_miss", "host_compute", "rule_015", "quality", "speed")
BENCH_POLICIES: dict[str, dict[str, Any]] = {
    **{name: STUDY_POLICIES[name] for name in _FROM_STUDY},
    ALL_RESIDENT: ALL_RESIDENT_POLICY.to_dict(),
}
# the calibration's mechanism runs (`moesub.engine.calibrate.MECHANISMS`); the hits runs here
# keep C slots and push every non-resident expert out of the logits (`hits_only`), over all
# layers and over one (which separates a token's fixed part from a layer's)
CALIBRATION_POLICIES: dict[str, dict[str, Any]] = {
    name: policy for name, policy in MECHANISMS.items() if policy is not None
}
CAL_HITS, CAL_HITS_ONE_LAYER = "cal_hits", "cal_hits_1layer"
ACT = torch.nn.functional.silu  # the benchmark's experts' activation (Qwen's)
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
    # tokens run before each round's share of a run's tokens (caches evolve, time not recorded)
    warmup: int = _DEFAULTS["warmup"]
    # interleaved rounds, each running every run's next share of its tokens (order varied)
    rounds: int = _DEFAULTS["rounds"]
    routing: str = _DEFAULTS["routing"]  # "trace" (a capture, `trace_dir`) or "synthetic"
    trace_dir: str | None = None  # capture directory of the trace (routing="trace")
    # tokens the frequency-initial set is counted on
    calib_tokens: int = _DEFAULTS["calib_tokens"]
    seed: int = _DEFAULTS["seed"]
    # disk tier expert file (default: beside out_path)
    store_path: str | None = _DEFAULTS["store_path"]
    staging_buffers: int = _DEFAULTS["staging_buffers"]
    threads: int | None = _DEFAULTS["threads"]  # torch's compute threads (None: as they are)
    progress: bool = True
    policies: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(BENCH_POLICIES))

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> BenchParams:
        p = options_from(cls, params, "engine-bench")
        # `policies` here are policy dicts; in the config, a list of names (the workflow maps it)
        options = {k: v for k, v in (params or {}).items() if k != "policies"}
        check_options(options, "engine.bench", "engine-bench")
        try:
            check_capacity(p.fraction, p.num_experts, p.top_k)
        except ValueError as e:
            raise ValueError(f"params.fraction: {e}") from e
        if p.rounds > min(p.tokens, p.calibration_tokens):
            raise ValueError(
                f"params.rounds={p.rounds}: every round runs a share of each run's measured "
                f"tokens, and there are {p.tokens} (params.tokens) and {p.calibration_tokens} "
                "per calibration run"
            )
        if not p.policies:
            raise ValueError("params.policies: at least one policy is required")
        for name, spec in p.policies.items():
            if name == ALL_RESIDENT:
                continue
            if spec.get("allocation", "uniform") != "uniform":
                raise ValueError(
                    f"params.policies.{name}: a planned allocation needs the model's allocation "
                    "artefact; the benchmark runs one slot count for every layer"
                )
            try:  # the pin spec resolved at the benchmark's C, as the runs will
                Policy.from_dict(policy_fields(spec))
                layer_pin(spec.get("pin", 0), p.capacity, p.top_k, spec.get("prefetch", 0))
            except ValueError as e:
                raise ValueError(f"params.policies.{name}: {e}") from None
        if p.routing == "trace" and not p.trace_dir:
            raise ValueError("params.routing='trace' needs params.trace_dir (a capture directory)")
        return p

    @property
    def calibration_tokens(self) -> int:
        """Measured tokens of each calibration run (half the validation runs', at least 64)."""
        return max(64, self.tokens // 2)

    @property
    def capacity(self) -> int:
        return check_capacity(self.fraction, self.num_experts, self.top_k)

    def layout(self) -> StoreLayout:
        return StoreLayout(self.layers, self.num_experts, self.hidden, self.width, self.dtype,
                           fingerprint=f"random-seed{self.seed}")  # fmt: skip


@dataclass
class BenchSetup:
    """Everything the runs are made from, ready before the first (`prepare_bench`)."""

    p: BenchParams
    dev: torch.device
    logits: BenchLogits
    ranking: np.ndarray  # (L, E) int32 the experts by calibration frequency, hottest first
    initial: np.ndarray  # (L, C) int32 frequency-initial resident set: the ranking's prefix
    hits: np.ndarray  # (T, L, E) the calibration logits, every selection resident
    router_w: list[torch.Tensor]  # per layer [E, H] on the device
    h0: torch.Tensor  # [1, H] on the device: every token's hidden state entering layer 0
    store: ExpertStore | None  # the disk tier's expert file
    image: SlotImage | None  # the initial set in RAM, read once: every disk tier loads from it
    host: HostExperts | None  # the CUDA tier's experts in pinned host memory
    order: list[str]  # the runs' names in run order (`round_order`)
    spare: dict[int, list[SlotBuffers]] = field(default_factory=dict)  # by capacity (`release`)

    def capacity(self, name: str) -> int:
        """Slots per layer of run `name`: E for all_resident, else C."""
        return self.p.num_experts if name == ALL_RESIDENT else self.p.capacity

    def make_tier(self, capacity: int) -> DiskTier | CudaTier:
        """A fresh tier; a disk tier in the slot buffers a closed one left (`release`)."""
        p = self.p
        if self.dev.type == "cpu":
            slots = self.spare.pop(capacity, None)
            return DiskTier(self.store, capacity, p.top_k, ACT, p.staging_buffers, self.image,
                            slots)  # fmt: skip
        return CudaTier(self.host, capacity, self.dev, ACT, p.staging_buffers, top_k=p.top_k)

    def release(self, engine: OffloadEngine) -> None:
        """Close a run's engine, keeping a disk tier's slots for the next tier. Allocated afresh
        every run, their 1.5 GiB's pages were backed again by the load's first writes: on this
        VM nearly half the bench's time (344 s against 195 s kept; docs/measurements.md)."""
        if isinstance(engine.tier, DiskTier):
            self.spare[engine.tier.slots[0].capacity] = engine.tier.slots
        engine.close()

    def policy(self, name: str) -> Policy:
        """The policy run `name` runs (its pins resolved per layer)."""
        if name in (ALL_RESIDENT, CAL_HITS, CAL_HITS_ONE_LAYER):
            return ALL_RESIDENT_POLICY
        if name in CALIBRATION_POLICIES:
            return Policy.from_dict(CALIBRATION_POLICIES[name])
        spec = self.p.policies[name]  # its pin spec resolved at C (`moesub.layout`)
        return build_layout(self.ranking, self.p.fraction, spec, self.p.top_k).policy(spec)

    def logits_of(self, name: str) -> tuple[np.ndarray, int | None]:
        """Run `name`'s logits (T, L, E) and the layers it drives (None: all)."""
        if name in (CAL_HITS, CAL_HITS_ONE_LAYER):
            return self.hits, 1 if name == CAL_HITS_ONE_LAYER else None
        if name in CALIBRATION_POLICIES:
            return self.logits.calibration, None
        return self.logits.validation, None

    def engine(self, name: str, tier) -> tuple[OffloadEngine, np.ndarray, int | None]:
        """The engine of run `name` on its tier, with its logits and layers (`logits_of`)."""
        p, E, L = self.p, self.p.num_experts, self.p.layers
        initial = self.initial
        if name == ALL_RESIDENT:
            initial = np.tile(np.arange(E, dtype=np.int32), (L, 1))
        pol = self.policy(name)
        engine = OffloadEngine(tier, E, p.top_k, self.capacity(name), pol, initial, ACT)
        return engine, *self.logits_of(name)

    def close(self) -> None:
        self.image, self.spare = None, {}
        if self.store is not None:
            self.store.close()


def prepare_bench(p: BenchParams, dev: torch.device, out_path: Path) -> BenchSetup:
    """Resources checked, router logits made (or mapped from the trace), the expert store
    opened (written once) or the pinned experts filled, the real-size routers made."""
    lay, C, k, E, L = p.layout(), p.capacity, p.top_k, p.num_experts, p.layers
    store_path = check_resources(p, dev, out_path)
    logits = bench_logits(
        p.routing, L, E, p.calib_tokens, p.warmup + p.tokens, p.warmup + p.calibration_tokens,
        p.seed, p.trace_dir,
    )  # fmt: skip
    store = image = None
    ranking = frequency_initial(logits.initial, k, E)
    initial = np.ascontiguousarray(ranking[:, :C])
    if dev.type == "cpu":
        store = open_or_write_store(store_path, lay, random_experts(lay, p.seed), p.progress)
        image = SlotImage.read(store, initial)
    g = torch.Generator().manual_seed(p.seed + 1)
    dt = lay.torch_dtype
    router_w = [
        (torch.randn(E, p.hidden, generator=g) * p.hidden**-0.5).to(device=dev, dtype=dt)
        for _ in range(L)
    ]
    h0 = torch.randn(1, p.hidden, generator=g).to(device=dev, dtype=dt)
    host = None
    if dev.type == "cuda":  # random experts made on the GPU, kept in pinned host memory
        host = HostExperts(None, layout=lay, fill=random_fill(lay, p.seed, dev))
    cal_names = [CAL_HITS, *CALIBRATION_POLICIES] + ([CAL_HITS_ONE_LAYER] if L > 1 else [])
    order = round_order(spread(cal_names, list(p.policies)), p.rounds)
    hits = hits_only(logits.calibration, initial)
    return BenchSetup(
        p, dev, logits, ranking, initial, hits, router_w, h0, store, image, host, order
    )


@dataclass
class _Rounds:
    """What the rounds measured."""

    runs: dict[str, list[BenchRun]]  # per run name, one per round
    micro: list[dict[str, float]]  # per round, the terms timed in isolation (`microbenchmarks`)
    tier: str  # the tier's description
    kind: str  # the tier's kind (a CUDA tier's depends on where its host copy lives)
    host_reads_link: bool  # the tier's host reads its experts over the link (the disk tier)


def _run_rounds(plan: BenchSetup, info: dict[str, Any]) -> _Rounds:
    """The policies and the calibration runs in interleaved rounds, each run (its share of its
    tokens, `round_part`) on a fresh tier (C slots per layer; all_resident's E, kept across its
    rounds, whose runs must only hit): a run inherits no thread state from the one before (a
    shared tier's host worker once kept an OpenMP team after a host_compute run, and every later
    run was ~2-3 ms per token slower). The fast tier's expert and its drags are timed in every
    round, on the slots of the round's first C-slot run once it has filled them."""
    p, C = plan.p, plan.p.capacity
    names = [*p.policies, CAL_HITS, *CALIBRATION_POLICIES, CAL_HITS_ONE_LAYER]
    runs: dict[str, list[BenchRun]] = {n: [] for n in names}
    per_round = len(plan.order) // p.rounds
    micro: list[dict[str, float]] = []
    if plan.store is not None:  # the disk's read rate, for the record
        bw = measure_read_bandwidth(plan.store, reads=32, seed=p.seed)
        info.update(disk_read_bandwidth_Bps=bw.bytes_per_s, disk_read_latency_s=bw.latency_s,
                    store_mode=bw.mode)  # fmt: skip
    tier, engine, description, kind, host_reads_link = None, None, "", "", False
    # all_resident's engine, kept across its rounds: its slots hold every expert and never
    # change (its runs only hit), and loading them again read 4.5 GiB a round from the disk
    # tier's file (the experts outside the initial set's image)
    kept: OffloadEngine | None = None
    try:
        for i, name in enumerate(plan.order):
            if name == ALL_RESIDENT and kept is not None:
                engine, trace, layers = kept, *plan.logits_of(name)
                engine.reset(load=False)  # fresh caches on the slots as they are
            else:
                tier = plan.make_tier(plan.capacity(name))
                engine, trace, layers = plan.engine(name, tier)
            description, kind = description or engine.tier.description, engine.tier.kind
            host_reads_link = engine.tier.host_reads_link
            only_hits = layers is not None or name in (CAL_HITS, ALL_RESIDENT)
            trace = trace[round_part(len(trace) - p.warmup, p.warmup, p.rounds, i // per_round)]
            show = p.progress and not name.startswith("cal_")
            run = run_policy(engine, trace, plan.router_w, plan.h0, p.warmup, name, show, layers)
            if only_hits and by_status(run.counts)["hit"].sum() != run.counts.sum():
                raise RuntimeError(f"run {name}: expected only hits")
            runs[name].append(run)
            # every round has C-slot runs (the calibration's): the first, on the slots it filled
            if len(micro) == i // per_round and plan.capacity(name) == C:
                engine.reset(load=False)  # with nothing in flight
                micro.append(microbenchmarks(engine.tier, p.top_k, seed=p.seed))
            if name == ALL_RESIDENT:
                kept = engine
            else:  # its landed copies' staging buffers back first: the drain needs them
                plan.release(engine)
            tier = engine = None  # frees the tier's other buffers (its slots are `spare`)
            gc.collect()
    finally:
        for left in {id(e): e for e in (engine, kept) if e is not None}.values():
            left.close()
        if engine is None and tier is not None:
            tier.close()
    return _Rounds(runs, micro, description, kind, host_reads_link)


def _policy_rows(
    plan: BenchSetup,
    rounds: _Rounds,
    costs: UnitCosts,
    run_disk: dict[str, list[UnitCosts]],
    reference: DiskClock | None,
    refits: list[UnitCosts],
) -> pl.DataFrame:
    """One row per policy over its rounds (`bench_runs.policy_row`: the pricing's estimate on
    the same tokens beside, at `costs`, at `run_disk`'s against the calibration's `reference`
    run, at each run's own speed, and with each round left out at `refits`), and the
    speedups."""
    from moesub.metrics import speedup  # the project's one speedup

    out = pl.DataFrame(
        [
            {
                "policy": name,
                "device": plan.dev.type,
                "tier": rounds.kind,
                "layers": plan.p.layers,
                **policy_row(
                    rounds.runs[name],
                    plan.policy(name).delay,
                    costs,
                    run_disk[name],
                    reference,
                    refits,
                ),
            }
            for name in plan.p.policies
        ]
    )
    med = dict(zip(out["policy"], out["time_per_token_median_s"], strict=True))
    for col, base in (("speedup_vs_fetch_every_miss", "fetch_every_miss"),
                      ("speedup_vs_host_compute", "host_compute")):  # fmt: skip
        times = out["time_per_token_median_s"].to_numpy()
        out = out.with_columns(
            pl.Series(col, speedup(med.get(base, np.nan), times), dtype=pl.Float64)
        )
    return out


def run_benchmark(
    params: Mapping[str, Any] | None,
    device: str,
    out_path: str | os.PathLike,
    counts_path: str | os.PathLike | None = None,
) -> pl.DataFrame:
    """Real-size engine benchmark on `device` ('cpu' = disk->RAM tier, 'cuda' = pinned->GPU).

    Writes one row per policy (module doc; the columns: docs/architecture.md) to `out_path`
    atomically and returns the table: per token means and medians over its rounds, the pricing's
    estimate `est_time_per_token_s` against the measured `time_per_token_mean_s` (both over all
    its tokens), `sim_rel_error = (est - mean) / mean`, and the same at each run's disk speed
    (`disk_read_s`, `est_at_run_disk_s`, `sim_rel_error_at_run_disk`). Also writes every run's
    per-token-layer counts to `counts_path` (default `counts_path_for(out_path)`;
    `moesub.engine.bench_runs.read_bench_counts` reads them). The runs compute with
    `params.threads` torch threads (`threads` column); the caller's after.
    """
    p, dev = BenchParams.from_dict(params), require_cuda(device)
    plan = prepare_bench(p, dev, Path(out_path))
    caller_threads = torch.get_num_threads()
    threads = p.threads or caller_threads
    info: dict[str, Any] = {"routing": plan.logits.source, "load_avg_start": os.getloadavg()}
    try:
        torch.set_num_threads(threads)
        rounds = _run_rounds(plan, info)
    finally:
        torch.set_num_threads(caller_threads)
        plan.close()
    info["load_avg_end"] = os.getloadavg()
    cal = (CAL_HITS, CAL_HITS_ONE_LAYER, *CALIBRATION_POLICIES)
    fit = (rounds.host_reads_link, p.top_k, p.layers, p.layout().expert_bytes)
    seconds, costs, reference = fit_bench_costs(rounds.runs, cal, rounds.micro, *fit, info)
    refits = refit_without_each_round(rounds.runs, cal, rounds.micro, *fit)
    run_disk = at_run_disk(rounds.runs, reference, costs)
    info["disk_read_s"] = {
        name: [r.disk.per_read_s if r.disk.reads else None for r in rs]
        for name, rs in rounds.runs.items()
    }
    out = _policy_rows(plan, rounds, costs, run_disk, reference, refits)
    out = out.with_columns(threads=threads)
    meta = {
        "device": str(dev),
        "tier": rounds.tier,
        "params": asdict(p),
        "capacity": p.capacity,
        "expert_bytes": p.layout().expert_bytes,
        "unit_costs": seconds,
        "threads": threads,
        "note": "routed experts + real-size router only (no attention / shared expert); "
        "est_time_per_token_s = each policy's own per-token-layer counts priced with the "
        "profile fitted to this run's calibration runs (other tokens), mean over its rounds; "
        "sim_rel_error = (est - time_per_token_mean_s) / the same",
        **info,
    }
    write_bench_counts(
        counts_path or counts_path_for(out_path), rounds.runs,
        {name: plan.policy(name) for name in rounds.runs}, capacity=p.capacity,
    )  # fmt: skip
    write_parquet(out, Path(out_path), metadata=meta)
    return out
