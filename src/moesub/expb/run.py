"""Forced-substitution emulation of one Experiment B run: a (design, condition, target mass) of
the study and matched designs, or a cell of the factorial design.

Every expert is available (no cache dynamics). Per token and MoE layer the condition's experts
(`moesub.expb.select` for the study design, the plan of `moesub.expb.plan` for the matched one,
of `moesub.expb.factorial` for a factorial cell) are substituted; everything else is computed
exactly. A substitute is the policy core's choice
(`moesub.policy.forced_substitution`: the highest-logit resident expert not in this token's
computed set) from a configurable resident set (default: the first C experts of each layer's
calibration ranking at `expb.fraction`: one static, uniform, unpinned set, whatever sizes and
layouts the policies run at). Streams go through the model in the capture's batches
(bit-identical NLL with the capture where nothing is substituted).

Per token the artefact records the realized mass per token-layer (`layer_mass`, the live gate
weights of what was substituted, and `mass`, their mean over the token's layers), the number of
substituted experts and the sum of their ranks (the rank confound), and how many were planned.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from moesub.artefacts import Trace, check_token_table, iter_streams, layout_for, load_trace
from moesub.config import check_options, expb_min_capacity, schema_defaults
from moesub.expb.factorial import (
    CELLS,
    FactorialPlan,
    FactorialSpec,
    check_feasible,
    factorial_plan,
)
from moesub.expb.factorial import feasibility_table as factorial_feasibility_table
from moesub.expb.plan import (
    FEASIBILITY_GRID,
    MatchedPlan,
    check_targets,
    feasibility_table,
    matched_plan,
)
from moesub.expb.select import STUDY_CONDITIONS, select_substitutions
from moesub.io import read_metadata, require_file, write_parquet
from moesub.models import RouterHook, moe_info, stream_batches, stream_nll
from moesub.params import options_from, torch_device
from moesub.policy import CORE_BUILD_ID, check_initial, forced_substitution
from moesub.replay import (
    BatchRouter,
    check_geometry,
    computed_ids,
    load_for_capture,
)

DESIGNS = ("study", "matched")
CONDITIONS = STUDY_CONDITIONS
TARGETS_KEY = "expb.designs.matched.masses"


# --------------------------------------------------------------------------- configuration
_DEFAULTS = schema_defaults("expb")  # workflow/schemas/config.schema.yaml


@dataclass(frozen=True)
class ExpBParams:
    """What an Experiment B job takes from config.yaml `expb:` (every key optional)."""

    fraction: float = _DEFAULTS["fraction"]  # resident set = ranking prefix at this fraction
    # "initial" | "all" (every expert may serve as a substitute)
    resident: str = _DEFAULTS["resident"]
    progress: bool = True
    max_streams: int | None = _DEFAULTS["max_streams"]
    # float32 | bfloat16 | float16; None = the capture's dtype
    dtype: str | None = _DEFAULTS["dtype"]
    device: str = _DEFAULTS["device"]  # torch device, or "auto" (cuda if available)
    seed: int = _DEFAULTS["seed"]  # the matched design's (stream, pos, layer) hash
    heavy_mass: float | None = None  # the matched design's heavy weight (required for it)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> ExpBParams:
        out = options_from(cls, params, "expb", section="expb")
        if out.heavy_mass is not None:  # from expb.designs.matched: checked by its schema
            check_options({"heavy_mass": out.heavy_mass}, "expb.designs.matched", "expb")
        return out


# --------------------------------------------------------------------------- router callback
@dataclass
class StudyRule:
    """The study design: the condition's experts chosen from the live gate weights."""

    condition: str
    target_mass: float

    def __call__(self, layer: int, weights: np.ndarray, selected: np.ndarray) -> np.ndarray:
        return select_substitutions(weights, self.condition, self.target_mass)

    def planned(self, layer: int, mask: np.ndarray) -> np.ndarray:
        """(T,) experts the rule chose (all of them are substituted)."""
        return mask.sum(axis=1)


@dataclass
class PlannedIds:
    """The matched and factorial designs: the planned experts (T, L, k) ids, -1 = none,
    substituted where they are still in the live top-k at rank >= 2."""

    ids: np.ndarray  # (T, L, k) int32

    def __call__(self, layer: int, weights: np.ndarray, selected: np.ndarray) -> np.ndarray:
        planned = self.ids[:, layer]  # (T, k)
        if planned.shape != selected.shape:
            raise RuntimeError(f"plan has {planned.shape} rows, the model routed {selected.shape}")
        hit = (selected[:, :, None] == planned[:, None, :]).any(axis=2)  # (T, k)
        hit[:, 0] = False  # the live first choice is never substituted
        return hit

    def planned(self, layer: int, mask: np.ndarray) -> np.ndarray:
        """(T,) experts the plan chose, substituted or not."""
        return (self.ids[:, layer] >= 0).sum(axis=1)


@dataclass
class ForcedRouter:
    """RouterHook callback for one stream: substitute `select`'s experts at every layer."""

    resident: np.ndarray  # (L, C) int32 experts that may serve as substitutes
    select: StudyRule | PlannedIds
    k: int
    _parts: list[list[tuple]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._parts = [[] for _ in range(len(self.resident))]

    def decide(self, layer: int, z: np.ndarray):
        """Core decisions for logits z (N, E) float32: (ids, selected, realized mass, n_sub,
        rank sum, planned) per row."""
        none = np.zeros((z.shape[0], self.k), dtype=bool)
        _, weights, selected = forced_substitution(z, self.k, self.resident[layer], none)
        mask = self.select(layer, weights, selected)
        ids, _, sel = forced_substitution(z, self.k, self.resident[layer], mask)
        if not np.array_equal(sel, selected):
            raise RuntimeError("forced_substitution selected different experts for the same logits")
        done = mask & (ids != selected)
        realized = np.where(done, weights, 0.0).sum(axis=1)
        rank_sum = (done * np.arange(1, self.k + 1)).sum(axis=1)
        return ids, selected, realized, done.sum(axis=1), rank_sum, self.select.planned(layer, mask)

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        z = np.ascontiguousarray(logits.detach().to(torch.float32).cpu().numpy())  # (N, E)
        new_ids, selected, *recorded = self.decide(layer, z)  # realized, n_sub, rank_sum, planned
        self._parts[layer].append(tuple(recorded))
        return computed_ids(ids, selected, new_ids, logits)

    def take(self) -> tuple[np.ndarray, ...]:
        """(realized mass, substituted, rank sum, planned), each (T, L), since the last take."""
        cols = [
            np.stack([np.concatenate(c) for c in zip(*p, strict=True)], axis=0) for p in self._parts
        ]  # per layer: (4, T)
        self._parts = [[] for _ in range(len(self.resident))]
        return tuple(np.stack([c[i] for c in cols], axis=1) for i in range(4))


def expb_streams(
    model,
    token_table: Any,
    condition: str,
    resident: np.ndarray,
    target_mass: float | None = None,
    plan: MatchedPlan | FactorialPlan | None = None,
    progress: bool = True,
    max_streams: int | None = None,
    batch_tokens: int | None = None,
) -> tuple[pl.DataFrame, np.ndarray]:
    """Forced-substitution emulation of every stream: (per-token table, realized (N_tok, L)).

    The study design with `target_mass`, the matched design or a factorial cell with `plan` (its
    streams must be the emulated ones; `condition` names one of its `ids`). Columns: `stream,
    pos, doc_id, doc_start, nll, mass` (mean realized mass per token-layer over the token's
    layers), `layer_mass` list[L] (realized mass per token-layer), `n_sub` (substituted experts,
    summed over layers), `rank_sum` (their ranks, summed), `n_planned` (experts the plan or rule
    chose, summed; n_planned - n_sub were dropped).
    """
    info = moe_info(model)
    conditions = CONDITIONS if plan is None else tuple(plan.ids)
    if condition not in conditions:
        raise ValueError(f"condition must be one of {conditions}, got {condition!r}")
    if (target_mass is None) == (plan is None):
        raise ValueError("pass target_mass (study design) or plan (matched design), not both")
    df = check_token_table(token_table, info.vocab_size)
    resident = np.asarray(resident)
    if resident.ndim != 2 or resident.shape[0] != info.num_layers:
        raise ValueError(
            f"resident set has shape {resident.shape}, the model needs (L={info.num_layers}, C)"
        )
    resident = check_initial(resident, (info.num_layers, resident.shape[1]), info.num_experts)
    if resident.shape[1] < expb_min_capacity(info.top_k):
        raise ValueError(
            f"resident set of {resident.shape[1]} experts per layer is too small for k="
            f"{info.top_k}: every substituted rank needs a candidate (C >= 2k - 1)"
        )
    streams = [(s, rows) for s, rows in iter_streams(df)][:max_streams]
    if plan is not None:
        plan_of = dict(zip(plan.streams, plan.ids[condition], strict=True))
        for s, rows in streams:
            if s not in plan_of or plan_of[s].shape[:2] != (rows.height, info.num_layers):
                raise ValueError(f"the plan does not cover stream {s} ({rows.height} tokens)")

    def select(stream: int):
        return (
            StudyRule(condition, float(target_mass))
            if plan is None
            else PlannedIds(plan_of[stream])
        )

    frames, realized = [], []
    bar = tqdm(total=len(streams), desc=f"expb {condition}", unit="stream", disable=not progress)
    for batch in stream_batches([rows.height for _, rows in streams], batch_tokens):
        routers = [ForcedRouter(resident, select(streams[i][0]), info.top_k) for i in batch]
        ids = np.stack([streams[i][1]["token_id"].to_numpy() for i in batch])  # (B, T)
        with RouterHook(model, BatchRouter(routers)):
            nll = stream_nll(model, torch.from_numpy(ids.astype(np.int64)))
        for i, router, row_nll in zip(batch, routers, nll, strict=True):
            mass, n_sub, rank_sum, planned = router.take()  # each (T, L)
            realized.append(mass)
            frames.append(token_frame(streams[i][1], row_nll, mass, n_sub, rank_sum, planned))
        bar.update(len(batch))
    bar.close()
    return pl.concat(frames), np.concatenate(realized)


def token_frame(
    rows: pl.DataFrame,
    nll: np.ndarray,
    mass: np.ndarray,
    n_sub: np.ndarray,
    rank_sum: np.ndarray,
    planned: np.ndarray,
) -> pl.DataFrame:
    """One stream's per-token rows (the expb schema): nll (T,), the others (T, L)."""
    return (
        rows.select(
            pl.col("stream").cast(pl.Int32),
            pl.col("pos").cast(pl.Int32),
            pl.col("doc_id").cast(pl.Int32),
            pl.col("doc_start").cast(pl.Boolean),
        )
        .with_columns(
            pl.Series("nll", np.asarray(nll, np.float64), dtype=pl.Float64).fill_nan(None),
            pl.Series("mass", mass.mean(axis=1), dtype=pl.Float64),
            pl.Series("layer_mass", mass, dtype=pl.Array(pl.Float64, mass.shape[1])),
            pl.Series("n_sub", n_sub.sum(axis=1), dtype=pl.Int32),
            pl.Series("rank_sum", rank_sum.sum(axis=1), dtype=pl.Int32),
            pl.Series("n_planned", planned.sum(axis=1), dtype=pl.Int32),
        )
        .with_columns(pl.col("layer_mass").cast(pl.List(pl.Float64)))
    )


# --------------------------------------------------------------------------- stage entry points
def run_feasibility(
    router_path: str | os.PathLike,
    out_path: str | os.PathLike,
    heavy_mass: float,
    targets: list[float],
    grid: tuple[float, ...] = FEASIBILITY_GRID,
) -> Path:
    """The matched design's feasibility on the calibration router logits -> Parquet at
    `out_path` (one row per candidate heavy_mass, the configured one flagged). Raises
    ValueError naming `expb.designs.matched.masses` and the reachable range when a target is
    outside it (then nothing is written)."""
    trace = load_trace(require_file(router_path, "router_path"))
    table = feasibility_table(trace, grid, configured=float(heavy_mass))
    check_targets(table, float(heavy_mass), [float(m) for m in targets], TARGETS_KEY)
    meta = {"heavy_mass": float(heavy_mass), "targets": [float(m) for m in targets]}
    meta.update({k: trace.meta[k] for k in ("num_experts", "top_k", "num_layers")})
    meta["mass_unit"] = "per token-layer"
    return write_parquet(table, out_path, metadata=meta)


def _stream_subset(trace: Trace, streams: list[int]) -> Trace:
    index = {s: i for i, s in enumerate(trace.streams)}
    missing = [s for s in streams if s not in index]
    if missing:
        raise ValueError(f"router_path: the evaluation router table lacks stream(s) {missing[:5]}")
    return Trace(streams, [trace.logits[index[s]] for s in streams], trace.meta)


def run_expb(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    design: str,
    condition: str,
    target_mass: float,
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
    router_path: str | os.PathLike | None = None,
    feasibility_path: str | os.PathLike | None = None,
) -> Path:
    """One Experiment B (design, condition, target mass) -> per-token Parquet at `out_path`.

    The matched design also needs the evaluation capture's router table (`router_path`, the
    plan is made on it) and the feasibility table (`feasibility_path`: the target is checked
    against its reachable range before the model runs) and `params["heavy_mass"]`.
    Metadata: design, condition, target_mass, realized mass per token-layer (mean, and the
    share of token-layers with any substitution), the plan's figures, resident set, capacity.
    """
    require_file(model_dir, "model_dir")
    tokens_path = require_file(tokens_path, "tokens_path")
    opts = ExpBParams.from_dict(params)
    if opts.resident == "initial":
        ranking_path = require_file(ranking_path, "ranking_path")
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    if condition not in CONDITIONS:
        raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
    if not isinstance(target_mass, (int, float)) or not 0.0 < float(target_mass) < 1.0:
        raise ValueError(f"target_mass must be a number in (0, 1), got {target_mass!r}")
    target_mass = float(target_mass)
    if design == "matched":
        if opts.heavy_mass is None:
            raise ValueError("params.heavy_mass is required for the matched design")
        if router_path is None or feasibility_path is None:
            raise ValueError("the matched design needs router_path and feasibility_path")
        router_path = require_file(router_path, "router_path")
        feasible = pl.read_parquet(require_file(feasibility_path, "feasibility_path"))
        check_targets(feasible, float(opts.heavy_mass), [target_mass], TARGETS_KEY)

    model, info, tokens, dtype = load_for_capture(
        model_dir, tokens_path, opts.dtype, torch_device(opts.device)
    )
    resident, capacity = _resident_set(opts, info, ranking_path)
    meta: dict[str, Any] = {"design": design, "condition": condition, "target_mass": target_mass}
    plan = None
    if design == "matched":
        trace = load_trace(router_path)
        check_geometry(trace.meta, info, "router_path")
        streams = sorted(tokens["stream"].unique().to_list())[: opts.max_streams]
        plan = matched_plan(
            _stream_subset(trace, streams), float(opts.heavy_mass), target_mass, opts.seed
        )
        del trace
        meta.update(
            heavy_mass=float(opts.heavy_mass),
            seed=opts.seed,
            plan_share=plan.share,
            plan_support=plan.support,
            plan_heavy=plan.planned_heavy,
            plan_light=plan.planned_light,
            plan_token_layers=plan.planned_token_layers,
        )
    out, realized = expb_streams(
        model,
        tokens,
        condition,
        resident,
        target_mass=target_mass if plan is None else None,
        plan=plan,
        progress=opts.progress,
        max_streams=opts.max_streams,
        batch_tokens=read_metadata(tokens_path).get("batch_tokens"),
    )
    meta.update(_run_meta(opts, info, realized, capacity, dtype))
    return write_parquet(out, out_path, metadata=meta)


def _resident_set(opts: ExpBParams, info, ranking_path) -> tuple[np.ndarray, int]:
    """(resident (L, C) int32, C): the experts substitutes are drawn from."""
    if opts.resident == "all":
        resident = np.tile(np.arange(info.num_experts, dtype=np.int32), (info.num_layers, 1))
        return resident, info.num_experts
    # one static resident set at expb.fraction, uniform, unpinned: the expert ranking's first C
    # experts of every layer (no policy runs, so no pin or allocation applies)
    layout = layout_for(
        ranking_path, opts.fraction, {"rule": "fetch_all"}, info.top_k, info.num_layers,
        info.num_experts,
    )  # fmt: skip
    return layout.initial_array(), layout.size.capacity


def _run_meta(opts: ExpBParams, info, realized: np.ndarray, capacity: int, dtype: str) -> dict:
    """Metadata every run records: realized mass (N_tok, L), the resident set, the build."""
    return {
        "mass_unit": "per token-layer",
        "realized_mass_mean": float(realized.mean()),
        "realized_share_substituted": float((realized > 0).mean()),
        "resident": opts.resident,
        "fraction": float(opts.fraction) if opts.resident == "initial" else 1.0,
        "capacity": capacity,
        "num_layers": info.num_layers,
        "core_build_id": CORE_BUILD_ID,
        "dtype": dtype,
    }


# --------------------------------------------------------------------------- the factorial design
def run_factorial_feasibility(
    router_path: str | os.PathLike,
    out_path: str | os.PathLike,
    spec: Mapping[str, Any] | None,
    seed: int,
) -> Path:
    """The factorial design's plan on the calibration router logits -> Parquet at `out_path`
    (one row per cell; metadata: the spec and the plan's figures). Raises ValueError naming
    `expb.designs.factorial` when a cell has no support (then nothing is written)."""
    trace = load_trace(require_file(router_path, "router_path"))
    factorial = FactorialSpec.from_dict(spec)
    plan = factorial_plan(trace, factorial, seed)
    check_feasible(plan, factorial, "the calibration capture")
    meta = {"design": "factorial", "spec": factorial.as_dict(), "seed": seed, **plan.summary()}
    meta.update({k: trace.meta[k] for k in ("num_experts", "top_k", "num_layers")})
    return write_parquet(factorial_feasibility_table(plan, factorial), out_path, metadata=meta)


def run_factorial(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    ranking_path: str | os.PathLike,
    router_path: str | os.PathLike,
    feasibility_path: str | os.PathLike,
    cell: str,
    out_path: str | os.PathLike,
    spec: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> Path:
    """One cell of the factorial design -> per-token Parquet at `out_path` (the expb schema).

    The plan is made on the evaluation capture's router table (`router_path`) before the model
    loads; the calibration feasibility table (`feasibility_path`) must be the one of this spec.
    Metadata: design, condition (= the cell), the spec, the plan's figures (`plan_*`), the run's.
    """
    require_file(model_dir, "model_dir")
    tokens_path = require_file(tokens_path, "tokens_path")
    router_path = require_file(router_path, "router_path")
    opts = ExpBParams.from_dict(params)
    factorial = FactorialSpec.from_dict(spec)
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {CELLS}, got {cell!r}")
    if opts.resident == "initial":
        ranking_path = require_file(ranking_path, "ranking_path")
    feasible = read_metadata(require_file(feasibility_path, "feasibility_path"))
    if feasible.get("spec") != factorial.as_dict() or feasible.get("seed") != opts.seed:
        raise ValueError(
            f"feasibility_path: made for {feasible.get('spec')} (seed {feasible.get('seed')}), "
            f"not for this run's {factorial.as_dict()} (seed {opts.seed}): rerun the feasibility"
        )
    streams = sorted(pl.read_parquet(tokens_path, columns=["stream"])["stream"].unique())
    trace = load_trace(router_path)
    plan = factorial_plan(_stream_subset(trace, streams[: opts.max_streams]), factorial, opts.seed)
    check_feasible(plan, factorial, "the evaluation capture")
    meta: dict[str, Any] = {"design": "factorial", "condition": cell, "spec": factorial.as_dict()}
    meta.update({f"plan_{k}": v for k, v in plan.summary().items()}, seed=opts.seed)
    model, info, tokens, dtype = load_for_capture(
        model_dir, tokens_path, opts.dtype, torch_device(opts.device)
    )
    check_geometry(trace.meta, info, "router_path")
    del trace
    resident, capacity = _resident_set(opts, info, ranking_path)
    out, realized = expb_streams(
        model,
        tokens,
        cell,
        resident,
        plan=plan,
        progress=opts.progress,
        max_streams=opts.max_streams,
        batch_tokens=read_metadata(tokens_path).get("batch_tokens"),
    )
    meta.update(_run_meta(opts, info, realized, capacity, dtype))
    return write_parquet(out, out_path, metadata=meta)
