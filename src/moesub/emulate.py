"""Exact emulation of a model under a cache/substitution policy (stage 4 of docs/architecture.md).

The model is recomputed with teacher forcing over each token stream. At every MoE layer a router
hook hands that layer's logits for the whole stream to the policy core (`moesub.policy.LayerCache`,
one cache per layer, fresh from the initial resident set for every stream), and the experts are
computed with the ids the core returns (a substitute in SUB slots, the original expert otherwise).

This *layer-major* form is exact: caches are per layer, and a token's routing at layer `l` depends
only on earlier tokens (at every layer) and on earlier layers (for the same token), all of which
are already final when layer `l` runs over the whole stream. `emulate_token_by_token` decodes one
token at a time with the KV cache instead; it is kept only as the test oracle for that argument.
`greedy_decode` is the same machinery for free-running generation (used by `moesub.generate`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from moesub.capture import read_initial_set
from moesub.io import read_metadata, write_parquet
from moesub.models import (
    RouterHook,
    align_ids,
    load_model,
    moe_info,
    stream_batches,
    stream_nll,
)
from moesub.params import options_from, torch_device
from moesub.policy import CORE_BUILD_ID, LayerCache, Policy
from moesub.policy import capacity_for as policy_capacity_for

STATUS_NAMES = ("hit", "fetch", "sub", "host", "forced")  # index = status code
TOKEN_COLUMNS = ("stream", "pos", "token_id", "doc_id", "doc_start")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class EmulateParams:
    """The `emulate:` section of config.yaml (every key optional)."""

    progress: bool = True  # tqdm over streams
    max_streams: int | None = None  # emulate only the first n streams (smoke runs)
    dtype: str | None = None  # float32 | bfloat16 | float16; None = the capture's dtype
    device: str = "cpu"  # torch device, or "auto" (cuda if available)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> EmulateParams:
        out = options_from(cls, params, "emulate")
        check_replay_options(out.max_streams, out.dtype)
        return out


def check_replay_options(max_streams: int | None, dtype: str | None) -> None:
    """The options emulate and Experiment B share: a stream limit and the model dtype."""
    if max_streams is not None and int(max_streams) < 1:
        raise ValueError(f"params.max_streams must be >= 1, got {max_streams}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"params.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def capacity_for(fraction: float, num_experts: int, k: int) -> int:
    """Resident experts per layer, `floor(fraction * E + 0.5)`, checked against k <= C <= E."""
    if not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    capacity = policy_capacity_for(float(fraction), num_experts)
    if not k <= capacity <= num_experts:
        raise ValueError(
            f"fraction {fraction} gives capacity {capacity}, outside [k={k}, E={num_experts}]"
        )
    return capacity


def policy_from_dict(policy: Mapping[str, Any] | Any):
    """`moesub.policy.Policy` from a config dict, with errors that name the `policy` argument."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, Mapping):
        raise ValueError(f"policy must be a dict (rule, tau, eviction, ...), got {policy!r}")
    try:
        return Policy.from_dict(dict(policy))
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"policy {dict(policy)!r} is invalid: {exc}") from exc


def check_initial(initial: np.ndarray | None, num_layers: int, num_experts: int, capacity: int):
    """An initial resident set must be `(L, C)` distinct expert ids in `[0, E)` per layer."""
    if initial is None:
        return None
    initial = np.asarray(initial)
    if initial.shape != (num_layers, capacity):
        raise ValueError(
            f"initial resident set has shape {initial.shape}, the model needs "
            f"(L={num_layers}, C={capacity})"
        )
    if not np.issubdtype(initial.dtype, np.integer):
        raise ValueError(f"initial resident set must hold integer expert ids, got {initial.dtype}")
    if initial.size and (initial.min() < 0 or initial.max() >= num_experts):
        raise ValueError(
            f"initial resident set holds expert ids outside [0, E={num_experts}): "
            f"min {initial.min()}, max {initial.max()}"
        )
    for layer, row in enumerate(initial):
        if np.unique(row).size != row.size:
            raise ValueError(f"initial resident set of layer {layer} repeats an expert")
    return initial.astype(np.int32)


def check_token_table(table: Any, vocab_size: int) -> pl.DataFrame:
    """The token table as polars, sorted by (stream, pos), checked against the model's vocab."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    if not isinstance(df, pl.DataFrame):
        raise ValueError("token table must be a table (polars / pyarrow), not a single column")
    missing = [c for c in TOKEN_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"token table lacks column(s) {missing}; has {df.columns}")
    if df.height == 0:
        raise ValueError("token table is empty")
    df = df.sort("stream", "pos")
    lo, hi = df["token_id"].min(), df["token_id"].max()
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"token table holds token ids in [{lo}, {hi}] but the model's vocabulary has "
            f"{vocab_size} entries: the streams were not tokenized for this model"
        )
    bad = (
        df.group_by("stream")
        .agg(ok=(pl.col("pos") == pl.int_range(pl.len())).all())
        .filter(~pl.col("ok"))
    )
    if bad.height:
        raise ValueError(
            f"token table: positions of stream(s) {bad['stream'].to_list()[:5]} are not 0..T-1"
        )
    return df


def iter_streams(df: pl.DataFrame) -> Iterator[tuple[int, pl.DataFrame]]:
    """(stream id, its rows in position order) for every stream of a checked token table."""
    for (stream,), rows in df.group_by("stream", maintain_order=True):
        yield int(stream), rows


# --------------------------------------------------------------------------- the router callback
@dataclass
class StreamTrace:
    """What the core decided for one stream, layer by layer (T tokens, L layers, top-k)."""

    nll: np.ndarray  # float64 (T,), NaN at pos 0
    mass: np.ndarray  # float64 (T, L) substituted gate mass
    counts: np.ndarray  # int64 (T, 5) slots per status code, summed over layers
    status: np.ndarray | None = None  # int8 (T, L, k), when recorded
    ids: np.ndarray | None = None  # int32 (T, L, k) computed expert, when recorded
    selected: np.ndarray | None = None  # int32 (T, L, k) router's choice, when recorded
    admissions: int = 0  # admission requests made by the core, summed over layers


@dataclass
class PolicyRouter:
    """RouterHook callback: layer l's rows go through `caches[l]`; the core's ids are computed.

    Rows arrive in stream order (the whole stream at once, or one decode step at a time); each
    call advances that layer's cache clock by the number of rows. `record` keeps ids and status
    for the tests; otherwise only mass and per-status counts are kept.
    """

    caches: list
    record: bool = False
    _parts: list[list[tuple]] = field(default_factory=list)
    _admissions: int = 0

    def __post_init__(self) -> None:
        self._parts = [[] for _ in self.caches]

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        z = logits.detach().to(torch.float32).cpu().numpy()  # (N, E) float32
        s = self.caches[layer].step(np.ascontiguousarray(z))
        status = np.asarray(s.status)
        counts = np.stack([(status == c).sum(axis=1) for c in range(len(STATUS_NAMES))], axis=1)
        part = (np.asarray(s.mass, dtype=np.float64), counts)
        if self.record:
            part += (status.copy(), np.asarray(s.ids).copy(), np.asarray(s.selected).copy())
        self._parts[layer].append(part)
        self._admissions += len(s.admissions)
        return computed_ids(ids, s.selected, s.ids, logits)

    def last_mass(self) -> float:
        """Substituted mass of the most recent row, summed over layers."""
        return float(sum(parts[-1][0][-1] for parts in self._parts if parts))

    def take(self, nll: np.ndarray) -> StreamTrace:
        """Everything recorded since the last `take`, as a StreamTrace; resets the buffers."""
        if any(not parts for parts in self._parts):
            raise RuntimeError("router hook did not see every MoE layer")
        per_layer = [
            tuple(np.concatenate(column) for column in zip(*parts, strict=True))
            for parts in self._parts
        ]
        self._parts = [[] for _ in self.caches]
        admissions, self._admissions = self._admissions, 0
        lengths = {p[0].shape[0] for p in per_layer}
        if lengths != {len(nll)}:
            raise RuntimeError(
                f"router hook saw {sorted(lengths)} rows per layer for a {len(nll)}-token stream"
            )
        trace = StreamTrace(
            nll=np.asarray(nll, dtype=np.float64),
            mass=np.stack([p[0] for p in per_layer], axis=1),
            counts=np.sum([p[1] for p in per_layer], axis=0).astype(np.int64),
            admissions=admissions,
        )
        if self.record:
            trace.status = np.stack([p[2] for p in per_layer], axis=1)
            trace.ids = np.stack([p[3] for p in per_layer], axis=1)
            trace.selected = np.stack([p[4] for p in per_layer], axis=1)
        return trace


def computed_ids(
    model_ids: torch.Tensor, selected: np.ndarray, computed: np.ndarray, logits: torch.Tensor
) -> torch.Tensor | None:
    """Replacement ids for the router hook: None when the model's own choice stands (every
    rank computes its selected expert), the core's ids directly when the model's slot order is
    the core's rank order (the usual case), `align_ids` otherwise (ties, other slot orders)."""
    if model_ids.device.type == "cpu" and np.array_equal(model_ids.numpy(), selected):
        if np.array_equal(computed, selected):
            return None
        return torch.from_numpy(np.ascontiguousarray(computed)).to(model_ids.dtype)
    return align_ids(model_ids, selected, computed, logits=logits)


@dataclass
class BatchRouter:
    """RouterHook callback for a forward over B equal-length streams: the hook's N = B*T rows
    are batch-major, so stream b's rows `[b*T, (b+1)*T)` go through `routers[b]` (its own
    per-layer caches); the replacement ids are concatenated back in the same order."""

    routers: list[PolicyRouter]

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        T = logits.shape[0] // len(self.routers)
        rows = [slice(b * T, (b + 1) * T) for b in range(len(self.routers))]
        new = [
            r(layer, logits[s], weights[s], ids[s]) for r, s in zip(self.routers, rows, strict=True)
        ]
        if all(n is None for n in new):
            return None
        return torch.cat(
            [ids[s] if n is None else n.to(ids.device) for n, s in zip(new, rows, strict=True)]
        )


def make_caches(model, policy, capacity: int, initial: np.ndarray | None) -> list:
    """One fresh `LayerCache` per MoE layer (initial row l, or experts 0..C-1 when None)."""
    info = moe_info(model)
    initial = check_initial(initial, info.num_layers, info.num_experts, capacity)
    return [
        LayerCache(
            num_experts=info.num_experts,
            k=info.top_k,
            capacity=capacity,
            policy=policy,
            initial=None if initial is None else initial[layer],
        )
        for layer in range(info.num_layers)
    ]


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def emulate_batch(
    model, ids: np.ndarray, policy, capacity: int, initial=None, record=False
) -> list[StreamTrace]:
    """Layer-major emulation of B equal-length streams `ids` (B, T) in one teacher-forced
    forward (`stream_nll`); every stream has its own fresh per-layer caches."""
    ids = np.asarray(ids, dtype=np.int64)
    routers = [
        PolicyRouter(make_caches(model, policy, capacity, initial), record=record) for _ in ids
    ]
    with RouterHook(model, BatchRouter(routers)):
        nll = stream_nll(model, torch.from_numpy(ids).to(model_device(model)))  # (B, T)
    return [r.take(row) for r, row in zip(routers, nll, strict=True)]


def emulate_stream(
    model, ids: Sequence[int] | np.ndarray, policy, capacity: int, initial=None, record=False
) -> StreamTrace:
    """Layer-major emulation of one stream (a batch of one)."""
    ids = np.asarray(ids, dtype=np.int64)[None]  # (1, T)
    return emulate_batch(model, ids, policy, capacity, initial, record)[0]


def emulate_streams(
    model,
    token_table: Any,
    policy,
    capacity: int,
    initial: np.ndarray | None = None,
    progress: bool = True,
    max_streams: int | None = None,
    batch_tokens: int | None = None,
) -> pl.DataFrame:
    """Emulate every stream of a token table under `policy`; one row per token.

    Columns: `stream, pos, doc_id, doc_start, nll, mass (sum over layers), layer_mass list[L],
    hit, fetch, sub, host, forced` (slot counts summed over layers). Each stream starts from a
    fresh cache per layer holding `initial` (L, C). Streams are batched as the capture batched
    them (`batch_tokens`, from the capture's metadata; None = one stream per forward), which
    bit-identical NLL needs.
    """

    info = moe_info(model)
    policy = policy_from_dict(policy)
    df = check_token_table(token_table, info.vocab_size)
    initial = check_initial(initial, info.num_layers, info.num_experts, capacity)
    streams = [rows for _stream, rows in iter_streams(df)][:max_streams]
    frames = []
    bar = tqdm(total=len(streams), desc="emulate", unit="stream", disable=not progress)
    for batch in stream_batches([r.height for r in streams], batch_tokens):
        ids = np.stack([streams[i]["token_id"].to_numpy() for i in batch])  # (B, T)
        for i, trace in zip(
            batch, emulate_batch(model, ids, policy, capacity, initial), strict=True
        ):
            frames.append(stream_frame(streams[i], trace.nll, trace.mass, trace.counts))
        bar.update(len(batch))
    bar.close()
    return pl.concat(frames)


def stream_frame(
    rows: pl.DataFrame, nll: np.ndarray, layer_mass: np.ndarray, counts: np.ndarray
) -> pl.DataFrame:
    """Per-token output rows of one stream (the emulate schema)."""
    num_layers = layer_mass.shape[1]
    out = rows.select(
        pl.col("stream").cast(pl.Int32),
        pl.col("pos").cast(pl.Int32),
        pl.col("doc_id").cast(pl.Int32),
        pl.col("doc_start").cast(pl.Boolean),
    ).with_columns(
        pl.Series("nll", nll, dtype=pl.Float64).fill_nan(None),
        pl.Series("mass", layer_mass.sum(axis=1), dtype=pl.Float64),
        pl.Series("layer_mass", layer_mass, dtype=pl.Array(pl.Float64, num_layers)),
        *[
            pl.Series(name, counts[:, code], dtype=pl.Int32)
            for code, name in enumerate(STATUS_NAMES)
        ],
    )
    return out.with_columns(pl.col("layer_mass").cast(pl.List(pl.Float64)))


# --------------------------------------------------------------------------- token-by-token
@dataclass
class DecodeResult:
    """One greedy continuation: generated tokens (stop token excluded) and, per token, the
    substituted gate mass (summed over layers) of the forward step that produced it."""

    tokens: list[int]
    mass: list[float]
    stopped: bool  # True when a stop token ended it (before max_new_tokens)


def _forward_step(model, input_ids: torch.Tensor, cache):
    """One cached forward over input_ids [1, n]: (next-token logits of the last row [V] float64,
    the updated KV cache)."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True)
    return out.logits[0, -1].to(torch.float64), out.cache


def _router_context(model, router):
    if router is None:
        return contextlib.nullcontext()
    return RouterHook(model, router)


@torch.inference_mode()
def greedy_decode(
    model,
    prompts: list[list[int]],
    policy,
    capacity: int,
    initial: np.ndarray | None,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    progress: bool = False,
) -> list[DecodeResult]:
    """Greedy decoding with the KV cache under `policy` (None = the exact model).

    Each prompt gets fresh per-layer caches; the prompt is prefilled as one chunk through the
    same `LayerCache`s that then see one row per generated token.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if policy is not None:
        policy = policy_from_dict(policy)
    device = model_device(model)
    results = []
    for prompt in tqdm(prompts, desc="decode", unit="prompt", disable=not progress):
        if len(prompt) == 0:
            raise ValueError("prompts: every prompt needs at least one token")
        router = (
            None if policy is None else PolicyRouter(make_caches(model, policy, capacity, initial))
        )
        tokens: list[int] = []
        masses: list[float] = []
        stopped = False
        with _router_context(model, router):
            step_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)  # (1, P)
            cache = None
            while len(tokens) < max_new_tokens:
                logits, cache = _forward_step(model, step_ids, cache)
                nxt = int(torch.argmax(logits))
                if nxt in stop_ids:
                    stopped = True
                    break
                tokens.append(nxt)
                masses.append(0.0 if router is None else router.last_mass())
                step_ids = torch.tensor([[nxt]], dtype=torch.long, device=device)
        results.append(DecodeResult(tokens=tokens, mass=masses, stopped=stopped))
    return results


@torch.inference_mode()
def emulate_token_by_token(
    model, ids: Sequence[int] | np.ndarray, policy, capacity: int, initial=None
) -> StreamTrace:
    """Test oracle: teacher-forced decoding one token at a time with the KV cache, the core
    called per token and layer. Must equal `emulate_stream` (ids, status, NLL)."""
    policy = policy_from_dict(policy)
    router = PolicyRouter(make_caches(model, policy, capacity, initial), record=True)
    ids = np.asarray(ids, dtype=np.int64)
    device = model_device(model)
    nll = np.full(len(ids), np.nan)
    cache = None
    with _router_context(model, router):
        for t in range(len(ids)):
            step = torch.tensor([[ids[t]]], dtype=torch.long, device=device)
            logits, cache = _forward_step(model, step, cache)
            if t + 1 < len(ids):
                logp = torch.log_softmax(logits, dim=-1)
                nll[t + 1] = -float(logp[int(ids[t + 1])])
    return router.take(nll)


# --------------------------------------------------------------------------- stage entry point
def check_geometry(meta: Mapping[str, Any], info, arg: str) -> None:
    """A capture artefact's recorded E/k/L (metadata, when present) must match the model's."""
    for key, value in (
        ("num_experts", info.num_experts),
        ("top_k", info.top_k),
        ("num_layers", info.num_layers),
    ):
        if key in meta and int(meta[key]) != value:
            raise ValueError(
                f"{arg}: captured with {key}={meta[key]} but the model has {key}={value}: "
                "the capture was made with another model"
            )


def require_file(path: str | os.PathLike, arg: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{arg}: {path} does not exist")
    return path


def load_for_capture(
    model_dir: str | os.PathLike, tokens_path: Path, dtype: str | None, device: str
) -> tuple[Any, Any, pl.DataFrame, str]:
    """The model in the capture's dtype (unless `dtype` overrides it), checked against the
    capture token table (E/k/L recorded there, token ids within the vocabulary).

    Returns (model, MoEInfo, token table, dtype)."""
    token_meta = read_metadata(tokens_path)
    dtype = dtype or token_meta.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"tokens_path: capture dtype {dtype!r} not in {sorted(DTYPES)}")
    model, _tokenizer = load_model(model_dir, dtype=DTYPES[dtype], device=device)
    info = moe_info(model)
    check_geometry(token_meta, info, "tokens_path")
    tokens = check_token_table(pl.read_parquet(tokens_path), info.vocab_size)
    return model, info, tokens, dtype


def run_emulate(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    initial_sets_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    fraction: float,
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> Path:
    """Emulate one (model, policy, fraction): per-token Parquet (emulate schema) at `out_path`.

    Every input is checked before the model runs: the policy dict, the fraction, the token ids
    against the model's vocabulary, and the initial resident set against the model's L/E/C.
    """

    require_file(model_dir, "model_dir")
    tokens_path = require_file(tokens_path, "tokens_path")
    initial_sets_path = require_file(initial_sets_path, "initial_sets_path")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty policy name, got {name!r}")
    pol = policy_from_dict(policy)
    opts = EmulateParams.from_dict(params)
    if not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")

    model, info, tokens, dtype = load_for_capture(
        model_dir, tokens_path, opts.dtype, torch_device(opts.device)
    )
    capacity = capacity_for(fraction, info.num_experts, info.top_k)
    initial = check_initial(
        read_initial_set(initial_sets_path, fraction), info.num_layers, info.num_experts, capacity
    )
    out = emulate_streams(
        model,
        tokens,
        pol,
        capacity,
        initial,
        progress=opts.progress,
        max_streams=opts.max_streams,
        batch_tokens=read_metadata(tokens_path).get("batch_tokens"),
    )
    meta = {
        "policy": dict(policy),
        "name": name,
        "fraction": float(fraction),
        "capacity": capacity,
        "core_build_id": CORE_BUILD_ID,
        "num_layers": info.num_layers,
        "dtype": dtype,
    }
    return write_parquet(out, out_path, metadata=meta)


def summarize(paths: Mapping[str, str | os.PathLike], baseline: str = "fetch_every_miss"):
    """Per-policy summary of emulate outputs `{name: path}` over the same streams: perplexity,
    Δppl % vs `baseline` (moesub.stats.quality.dppl_pct, the project's one Δppl), substitution
    rate (SUB slots / all slots) and mean substituted mass per token-layer."""
    from moesub.stats.quality import dppl_pct

    rows, nll_mean = [], {}
    for name, path in paths.items():
        df = pl.read_parquet(require_file(path, f"paths[{name!r}]"))
        slots = df.select(pl.sum_horizontal(STATUS_NAMES).sum()).item()
        nll_mean[name] = df["nll"].drop_nulls().mean()
        rows.append(
            {
                "policy": name,
                "tokens": df.height,
                "ppl": math.exp(nll_mean[name]),
                "sub_rate": df["sub"].sum() / slots if slots else float("nan"),
                "hit_rate": df["hit"].sum() / slots if slots else float("nan"),
                # `mass` is the sum over the layers: per token-layer, the study's unit
                "mass_mean": (df["mass"] / df["layer_mass"].list.len()).mean(),
            }
        )
    out = pl.DataFrame(rows)
    if baseline in paths:
        dppl = [float(dppl_pct(nll_mean[n] - nll_mean[baseline])) for n in out["policy"]]
        out = out.with_columns(dppl_pct=pl.Series(dppl, dtype=pl.Float64))
    return out
