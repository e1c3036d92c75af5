"""The engine's decode loop over a real model: one token at a time with the KV cache.

One loop (`decode_tokens`) serves teacher forcing (`run_engine`: every stream token fed, NLL of
the next one) and free-running greedy generation (`EngineModel.generate` / `generate`: the prompt
fed token by token, then the argmax of each step fed back), from fresh caches every time.

Per token and MoE layer: the router runs on the fast device -> its logits go to the policy core
(`OffloadEngine.route`: completed admissions installed, core step, synchronous copies of
FETCH/FORCED experts into the slots the core freed, new admissions handed to the background)
-> the router hook returns the *cache slot* of every computed expert in the model's slot order
(`models.align_ids`) -> the block's experts module (replaced by `EngineExperts`) computes from
the slot tensors with one grouped matmul per projection, plus host_compute misses on the host.
The model's own expert weights are dropped: experts live only in the slow tier and the slots.
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from torch import nn
from tqdm.auto import tqdm

from moesub.engine.cache import CudaTier, DiskTier, require_cuda
from moesub.engine.runtime import ADMISSION_TIMINGS, OffloadEngine
from moesub.engine.store import (
    DTYPES,
    StoreLayout,
    dtype_name,
    measure_read_bandwidth,
    model_experts,
    open_or_write_store,
    tensor_fingerprint,
)
from moesub.io import write_parquet
from moesub.params import options_from
from moesub.policy import HOST, Policy

ALL_RESIDENT = "all_resident"  # reserved policy name: every expert in fast memory (the floor)
ROW_COLUMNS = (
    "stream", "pos", "wall_s", "fetch_wait_s", "bytes_sync", "bytes_bg",
    "hit", "fetch", "sub", "host", "forced", "nll",
)  # fmt: skip


@dataclass(frozen=True)
class EngineParams:
    """The `engine:` section of config.yaml (every key optional)."""

    dtype: str = "float32"  # model and expert dtype
    store_path: str | None = None  # expert file of the disk tier (default: beside the model)
    staging_buffers: int = 4  # background admissions in flight at most
    max_streams: int | None = None  # decode only the first n streams (smoke runs)
    max_tokens: int | None = None  # decode only the first n tokens of each stream
    threads: int | None = None  # torch CPU threads (None = torch's default)
    progress: bool = True
    calibrate_tokens: int = 32  # decode steps timed for dense_layer_s
    cost_path: str | None = None  # cost-model JSON (calibrate): adds the simulator's estimate
    # background admissions usable when their copy completes ("completion"), or exactly
    # policy.delay tokens after the request, waiting for the copy if needed ("delay": the
    # emulator's and simulator's decisions, token for token)
    admission: str = "completion"

    @classmethod
    def from_dict(cls, params: Mapping[str, Any] | None) -> EngineParams:
        p = options_from(cls, params, "engine")
        if p.dtype not in DTYPES:
            raise ValueError(f"params.dtype={p.dtype!r} not in {list(DTYPES)}")
        if p.admission not in ADMISSION_TIMINGS:
            raise ValueError(f"params.admission={p.admission!r} not in {list(ADMISSION_TIMINGS)}")
        for name in ("staging_buffers", "max_streams", "max_tokens", "threads", "calibrate_tokens"):
            v = getattr(p, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"params.{name}={v!r} must be a positive integer")
        return p


class EngineExperts(nn.Module):
    """Replaces a block's experts: computes from the engine's slots (ids = slot indices).

    Without an engine attached (dense-time calibration) it returns zeros. `gate_up_proj` /
    `down_proj` are the layer's slot tensors (plain attributes, not parameters: `model.to` leaves
    them where the tier put them), so the block still reads as a sparse MoE block.
    """

    def __init__(self, layer: int, slots) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = slots.gate_up  # (C, 2I, H)
        self.down_proj = slots.down  # (C, H, I)
        self.engine: OffloadEngine | None = None
        self.host_ids: np.ndarray | None = None  # (N, k) model slot order, set by the router

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.engine is None:
            return torch.zeros_like(hidden)
        return self.engine.compute(self.layer, hidden, top_k_index, top_k_weights, self.host_ids)


class EngineRouter:
    """RouterHook callback: the core decides, the engine copies, the experts see slot ids."""

    def __init__(self, engine: OffloadEngine, experts: list[EngineExperts]) -> None:
        self.engine, self.experts = engine, experts

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        from moesub.models import align_ids

        z = np.ascontiguousarray(logits.detach().float().cpu().numpy())  # (1, E)
        s = self.engine.route(layer, z)
        host = None
        if (s.status == HOST).any():
            computed = np.where(s.status == HOST, s.selected, -1)
            host = align_ids(ids.cpu(), s.selected, computed, logits=logits.cpu()).numpy()
        self.experts[layer].host_ids = host
        return align_ids(ids, s.selected, s.slot, logits=logits)  # slot per model slot, -1 HOST


@dataclass
class EngineSetup:
    """A loaded model whose experts live in a tier (see `build_engine_model`)."""

    model: nn.Module
    info: Any  # moesub.models.MoEInfo
    tier: DiskTier | CudaTier
    experts: list[EngineExperts]
    act: Any
    expert_bytes: int
    device: torch.device
    bandwidth: dict[str, Any] | None  # disk tier: measured read bandwidth


def default_store_path(model_dir: str | os.PathLike, dtype: str) -> Path:
    """`<model_dir>/../engine/experts-<dtype>.bin` (results/{model}/engine/ in the pipeline)."""
    return Path(model_dir).resolve().parent / "engine" / f"experts-{dtype}.bin"


def build_engine_model(
    model_dir: str | os.PathLike,
    device: str,
    opts: EngineParams,
    capacity: int | None,
    out_path: str | os.PathLike | None = None,
    measure_bandwidth: bool = False,
) -> EngineSetup:
    """Load the model, move its experts to the slow tier (disk file written once, or pinned host
    memory), allocate `capacity` slots per layer (default k) and swap in `EngineExperts`."""
    from moesub.models import expert_weights, load_model, moe_blocks, moe_info

    dev = require_cuda(device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dtype = DTYPES[opts.dtype]
    model, _tok = load_model(model_dir, dtype=dtype, device="cpu")
    info = moe_info(model)
    C = info.top_k if capacity is None else capacity
    if not info.top_k <= C <= info.num_experts:
        raise ValueError(
            f"cache capacity {C} is too small for k={info.top_k} (or exceeds E={info.num_experts})"
        )
    blocks = moe_blocks(model)
    weights = [expert_weights(b) for b in blocks]  # (E, 2I, H), (E, H, I) per layer
    act = blocks[0].experts.act_fn
    bandwidth = None
    if dev.type == "cpu":
        layout = StoreLayout(
            num_layers=info.num_layers,
            num_experts=info.num_experts,
            hidden=info.hidden_size,
            width=info.expert_width,
            dtype=dtype_name(dtype),
            fingerprint=tensor_fingerprint(
                t for gu, dn in weights for t in (gu[:, 0, :], dn[:, 0, :])
            ),
        )
        path = (
            Path(opts.store_path) if opts.store_path else default_store_path(model_dir, opts.dtype)
        )
        store = open_or_write_store(path, layout, model_experts(weights), progress=opts.progress)
        tier: DiskTier | CudaTier = DiskTier(store, C, info.top_k, act, opts.staging_buffers)
        if measure_bandwidth:
            bw = measure_read_bandwidth(store, reads=min(32, info.num_layers * info.num_experts))
            bandwidth = {"read_bandwidth_Bps": bw.bytes_per_s, "read_latency_s": bw.latency_s}
        expert_bytes = layout.expert_bytes
    else:
        host = [(gu.detach().contiguous(), dn.detach().contiguous()) for gu, dn in weights]
        tier = CudaTier(host, C, dev, act, opts.staging_buffers)
        expert_bytes = tier.expert_bytes
        del host
    experts = []
    for layer, block in enumerate(blocks):
        block.experts = EngineExperts(layer, tier.slots[layer])
        experts.append(block.experts)
    del weights
    gc.collect()
    model.to(dev)
    return EngineSetup(model, info, tier, experts, act, expert_bytes, dev, bandwidth)


def _step(model: nn.Module, token: int, cache: Any, device: torch.device):
    ids = torch.tensor([[token]], dtype=torch.long, device=device)
    out = model(input_ids=ids, cache=cache, use_cache=True)
    return out.logits[0, -1], out.cache


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
        logits, cache = _step(setup.model, tok, cache, setup.device)
        float(logits[0])  # synchronize
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) / setup.info.num_layers


@torch.inference_mode()
def decode_tokens(
    setup: EngineSetup,
    engine: OffloadEngine,
    inputs: Sequence[int] | np.ndarray,
    max_new_tokens: int = 0,
    stop_ids: Collection[int] = frozenset(),
) -> dict[str, Any]:
    """Decode from fresh caches, one token per step: feed `inputs` (P >= 1 tokens; NLL of each
    next input recorded), then continue greedily for up to `max_new_tokens` tokens (argmax of
    each step's logits fed back; a token in `stop_ids` ends it and is not kept).

    Returns per-step arrays over the S steps run (`wall_s, fetch_wait_s, admit_wait_s, mass,
    bytes_sync, bytes_bg` (S,), `counts` (S, 5), `nll` (S,) NaN where no input followed), plus
    `generated` (tokens), `stopped` and `admissions`. Generated token i came from step P-1+i;
    the last generated token is never fed (S = P + n - 1, or P + n when a stop token ended it).
    """
    P = len(inputs)
    if P == 0:
        raise ValueError("inputs: decoding needs at least one input token")
    engine.reset()
    S = P + max(max_new_tokens - 1, 0)  # most steps that can run
    cols = {c: np.zeros(S, np.float64) for c in ("wall_s", "fetch_wait_s", "admit_wait_s", "mass")}
    ints = {c: np.zeros(S, np.int64) for c in ("bytes_sync", "bytes_bg")}
    counts = np.zeros((S, 5), np.int64)
    nll = np.full(S, np.nan)
    generated: list[int] = []
    stopped = False
    admissions = 0
    cache, token, t = None, int(inputs[0]), 0
    for t in range(S):
        engine.begin_token()
        t0 = time.perf_counter()
        logits, cache = _step(setup.model, token, cache, setup.device)
        if t + 1 < P:  # teacher forcing: the next input is given
            token = int(inputs[t + 1])
            lp = torch.log_softmax(logits.float(), dim=-1)  # as moesub.models.stream_nll
            nll[t + 1] = -float(lp[token])
        elif max_new_tokens:  # free running: greedy (ties to the lower id, as torch.argmax)
            token = int(torch.argmax(logits))
        st = engine.end_token()  # synchronizes the fast device
        cols["wall_s"][t] = time.perf_counter() - t0
        cols["fetch_wait_s"][t] = st.fetch_wait_s
        cols["admit_wait_s"][t] = st.admit_wait_s
        cols["mass"][t] = st.mass
        ints["bytes_sync"][t] = st.bytes_sync
        ints["bytes_bg"][t] = st.bytes_bg
        counts[t] = st.counts
        admissions += st.admissions
        if t + 1 >= P and max_new_tokens:
            if token in stop_ids:
                stopped = True
                break
            generated.append(token)
            if len(generated) == max_new_tokens:
                break
    n = t + 1  # steps run
    out: dict[str, Any] = {c: v[:n] for c, v in {**cols, **ints}.items()}
    out.update(counts=counts[:n], nll=nll[:n], generated=generated, stopped=stopped)
    out["admissions"] = admissions
    return out


def decode_stream(
    setup: EngineSetup, engine: OffloadEngine, token_ids: np.ndarray
) -> dict[str, Any]:
    """Teacher-forced decoding of one stream from fresh caches; per-token measurements."""
    return decode_tokens(setup, engine, token_ids)


def _require_file(path: str | os.PathLike, arg: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{arg}: {str(p)!r} does not exist")
    return p


def summary(wall_s: np.ndarray, nll: np.ndarray) -> dict[str, float]:
    ok = np.isfinite(nll)
    return {
        "tokens": int(len(wall_s)),
        "time_per_token_median_s": float(np.median(wall_s)) if len(wall_s) else math.nan,
        "time_per_token_p90_s": float(np.percentile(wall_s, 90)) if len(wall_s) else math.nan,
        "time_per_token_mean_s": float(np.mean(wall_s)) if len(wall_s) else math.nan,
        "ppl": float(np.exp(nll[ok].mean())) if ok.any() else math.nan,
    }


@dataclass(frozen=True)
class EngineSpec:
    """Checked inputs of one engine (`resolve_engine`): nothing loaded yet."""

    name: str
    policy: Policy
    policy_meta: dict[str, Any]  # the policy as given (artefact metadata)
    fraction: float
    capacity: int  # C (E for all_resident)
    initial: np.ndarray  # int32 (L, C) resident set every stream / prompt starts from
    device: torch.device
    opts: EngineParams
    info: Any  # moesub.models.MoEInfo


def resolve_engine(
    model_dir: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any] | Policy | None,
    fraction: float,
    device: str,
    params: Mapping[str, Any] | None = None,
    initial: np.ndarray | None = None,
    initial_sets_path: str | os.PathLike | None = None,
) -> EngineSpec:
    """Check an engine's inputs without loading the model: the policy (ignored for
    `all_resident`), the fraction against the checkpoint's E and k, the engine options, the
    device, and the initial resident set: `initial` (L, C), read from `initial_sets_path` when
    given, or experts 0..C-1 when both are None (as `moesub.emulate`)."""
    from moesub.emulate import check_initial, policy_from_dict
    from moesub.models import check_checkpoint

    _require_file(model_dir, "model_dir")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty policy name, got {name!r}")
    all_resident = name == ALL_RESIDENT
    pol = Policy(rule="fetch_all") if all_resident else policy_from_dict(policy)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0.0 < float(fraction) <= 1.0
    ):
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    opts = EngineParams.from_dict(params)
    dev = require_cuda(device)
    info = check_checkpoint(model_dir)
    E, k, L = info.num_experts, info.top_k, info.num_layers
    capacity = math.floor(float(fraction) * E + 0.5)
    if all_resident:
        capacity, initial = E, np.tile(np.arange(E, dtype=np.int32), (L, 1))
    else:
        if capacity < k:
            raise ValueError(
                f"fraction {fraction} gives a cache of C={capacity} experts per layer, too small "
                f"for top-k={k} (E={E})"
            )
        if initial_sets_path is not None:
            from moesub.capture import read_initial_set

            _require_file(initial_sets_path, "initial_sets_path")
            initial = read_initial_set(initial_sets_path, fraction)
        initial = check_initial(initial, L, E, capacity)
        if initial is None:
            initial = np.tile(np.arange(capacity, dtype=np.int32), (L, 1))
    meta = pol.to_dict() if all_resident or isinstance(policy, Policy) else dict(policy)
    return EngineSpec(name, pol, meta, float(fraction), capacity, initial, dev, opts, info)


@dataclass
class EngineDecodeResult:
    """One greedy continuation on the engine: `tokens`, `mass`, `stopped` as
    `moesub.emulate.DecodeResult`; per generated token i, what the step that produced it cost
    (the step that fed the prompt's last token for i = 0)."""

    tokens: list[int]  # generated tokens, stop token excluded
    mass: list[float]  # substituted gate mass, summed over layers
    stopped: bool  # a stop token ended it (before max_new_tokens)
    wall_s: np.ndarray  # float64 (n,) synchronized wall time of the step
    fetch_wait_s: np.ndarray  # float64 (n,) blocked on synchronous copies
    admit_wait_s: np.ndarray  # float64 (n,) blocked on due admissions (admission="delay")
    bytes_sync: np.ndarray  # int64 (n,)
    bytes_bg: np.ndarray  # int64 (n,)
    counts: np.ndarray  # int64 (n, 5) slots per status code, summed over layers
    prompt_tokens: int  # P
    prompt_wall_s: float  # wall time of the P - 1 prompt steps that produced no token
    admissions: int  # admission requests over the whole decode

    @classmethod
    def empty(cls, prompt_tokens: int) -> EngineDecodeResult:
        """Nothing generated and no step run (max_new_tokens = 0)."""
        f, i = np.zeros(0, np.float64), np.zeros(0, np.int64)
        return cls([], [], False, f, f, f, i, i, np.zeros((0, 5), np.int64), prompt_tokens, 0.0, 0)

    @classmethod
    def from_steps(cls, r: dict[str, Any], prompt_tokens: int) -> EngineDecodeResult:
        n = len(r["generated"])
        gen = slice(prompt_tokens - 1, prompt_tokens - 1 + n)  # steps that produced a token
        return cls(
            tokens=list(r["generated"]),
            mass=r["mass"][gen].tolist(),
            stopped=bool(r["stopped"]),
            wall_s=r["wall_s"][gen],
            fetch_wait_s=r["fetch_wait_s"][gen],
            admit_wait_s=r["admit_wait_s"][gen],
            bytes_sync=r["bytes_sync"][gen],
            bytes_bg=r["bytes_bg"][gen],
            counts=r["counts"][gen],
            prompt_tokens=prompt_tokens,
            prompt_wall_s=float(r["wall_s"][: prompt_tokens - 1].sum()),
            admissions=int(r["admissions"]),
        )


def check_prompts(prompts: Any, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of token ids: a list of non-empty integer sequences in [0, vocab)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        arr = np.asarray(prompt)
        if isinstance(prompt, (str, bytes)) or arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {prompt!r}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(
                f"prompts[{i}] holds token ids in [{arr.min()}, {arr.max()}], outside the "
                f"model's vocabulary [0, {vocab_size})"
            )
        out.append(arr.astype(np.int64).tolist())
    return out


def _check_generation(max_new_tokens: Any, stop_ids: Any) -> frozenset[int]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Iterable):
        raise ValueError(f"stop_ids must be a collection of token ids, got {stop_ids!r}")
    stop = list(stop_ids)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in stop):
        raise ValueError(f"stop_ids must hold integer token ids, got {stop!r}")
    return frozenset(int(s) for s in stop)


class EngineModel:
    """A model whose routed experts live in the engine's tiers, decoding under one policy.

    Built once (model loaded, expert store opened or written once, slots allocated, router hook
    installed) and reused for any number of streams (`decode`) or prompts (`generate`); each
    starts from fresh caches holding the initial resident set. `close()` (or `with`) releases it.
    """

    def __init__(self, model_dir: str | os.PathLike, spec: EngineSpec, out_path=None) -> None:
        from moesub.models import RouterHook

        self.spec = spec
        self.setup = build_engine_model(
            model_dir, str(spec.device), spec.opts, spec.capacity, out_path, measure_bandwidth=True
        )
        info = self.setup.info
        try:
            self.engine = OffloadEngine(
                self.setup.tier, info.num_experts, info.top_k, spec.capacity, spec.policy,
                spec.initial, self.setup.act, admission=spec.opts.admission,
            )  # fmt: skip
        except BaseException:
            self.setup.tier.close()
            raise
        for m in self.setup.experts:
            m.engine = self.engine
        self._hook = RouterHook(self.setup.model, EngineRouter(self.engine, self.setup.experts))
        self._hook.__enter__()
        self.closed = False

    @property
    def vocab_size(self) -> int:
        return self.setup.info.vocab_size

    def decode(
        self,
        inputs: Sequence[int] | np.ndarray,
        max_new_tokens: int = 0,
        stop_ids: Collection[int] = frozenset(),
    ) -> dict[str, Any]:
        """`decode_tokens` on this engine (per-step measurements; see there)."""
        if self.closed:
            raise RuntimeError("this EngineModel is closed")
        return decode_tokens(self.setup, self.engine, inputs, max_new_tokens, stop_ids)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_ids: Iterable[int] = (),
        progress: bool | None = None,
    ) -> list[EngineDecodeResult]:
        """Greedy generation, one prompt at a time: the prompt fed token by token, then up to
        `max_new_tokens` tokens, each the argmax of the step before. Every input is checked
        before the first prompt runs."""
        stop = _check_generation(max_new_tokens, stop_ids)
        prompts = check_prompts(prompts, self.vocab_size)
        progress = self.spec.opts.progress if progress is None else progress
        results = []
        for prompt in tqdm(
            prompts, desc=f"engine generate {self.spec.name}", unit="prompt", disable=not progress
        ):
            if max_new_tokens == 0:  # nothing to generate: no step runs (as greedy_decode)
                results.append(EngineDecodeResult.empty(len(prompt)))
                continue
            r = self.decode(prompt, max_new_tokens, stop)
            results.append(EngineDecodeResult.from_steps(r, len(prompt)))
        return results

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hook.__exit__(None, None, None)
            self.engine.close()

    def __enter__(self) -> EngineModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_engine(
    model_dir: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any] | Policy | None,
    fraction: float,
    device: str = "cpu",
    initial: np.ndarray | None = None,
    params: Mapping[str, Any] | None = None,
) -> EngineModel:
    """Build an `EngineModel` (inputs checked first, see `resolve_engine`). `initial` (L, C) is
    the resident set every prompt starts from (None: experts 0..C-1, as `moesub.emulate`)."""
    spec = resolve_engine(model_dir, name, policy, fraction, device, params, initial=initial)
    return EngineModel(model_dir, spec)


def generate(
    model: EngineModel | str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Iterable[int] = (),
    *,
    name: str | None = None,
    policy: Mapping[str, Any] | Policy | None = None,
    fraction: float | None = None,
    device: str | None = None,
    initial: np.ndarray | None = None,
    params: Mapping[str, Any] | None = None,
    progress: bool | None = None,
) -> list[EngineDecodeResult]:
    """Greedy generation on the offloading engine (the engine's counterpart of
    `moesub.emulate.greedy_decode`; with params `admission="delay"` the same tokens).

    `model` is an `EngineModel` from `open_engine` (reused across calls; name, policy, fraction,
    device, initial and params were fixed when it was built and must not be passed) or a model
    directory (an engine is built for this call from them, then closed).
    """
    if isinstance(model, EngineModel):
        given = {
            k: v
            for k, v in dict(
                name=name, policy=policy, fraction=fraction, device=device, initial=initial,
                params=params,
            ).items()
            if v is not None
        }  # fmt: skip
        if given:
            raise ValueError(
                f"generate: {sorted(given)} are fixed when the engine is built (open_engine); "
                "do not pass them with an EngineModel"
            )
        return model.generate(prompts, max_new_tokens, stop_ids, progress)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be an EngineModel or a model directory, got {model!r}")
    spec = resolve_engine(model, name, policy, fraction, device or "cpu", params, initial=initial)
    _check_generation(max_new_tokens, stop_ids)
    check_prompts(prompts, spec.info.vocab_size)
    with EngineModel(model, spec) as eng:
        return eng.generate(prompts, max_new_tokens, stop_ids, progress)


def run_engine(
    model_dir: str | os.PathLike,
    tokens_path: str | os.PathLike,
    initial_sets_path: str | os.PathLike,
    name: str,
    policy: Mapping[str, Any],
    fraction: float,
    device: str,
    out_path: str | os.PathLike,
    params: Mapping[str, Any] | None = None,
) -> Path:
    """Decode every stream of a capture token table with the real offloading engine.

    Writes one row per token (`stream, pos, wall_s, fetch_wait_s, bytes_sync, bytes_bg, hit,
    fetch, sub, host, forced, nll`, plus `mass`) with metadata `policy, name, fraction,
    capacity, device, tier, ...` and a `summary` (median / p90 time per token, perplexity).
    `name == "all_resident"` holds every expert in fast memory (the floor on time per token).
    Each stream starts from fresh caches holding the initial set (as in emulate). Every input is
    checked before decoding; the output is written atomically at the end.
    """
    from moesub.emulate import check_token_table, iter_streams
    from moesub.policy import CORE_BUILD_ID

    _require_file(model_dir, "model_dir")
    tokens_path = _require_file(tokens_path, "tokens_path")
    spec = resolve_engine(
        model_dir, name, policy, fraction, device, params,
        initial_sets_path=None if name == ALL_RESIDENT else initial_sets_path,
    )  # fmt: skip
    opts = spec.opts
    tokens = check_token_table(pl.read_parquet(tokens_path), spec.info.vocab_size)
    streams = list(iter_streams(tokens))[: opts.max_streams]

    frames = []
    admissions, admit_wait_s = 0, 0.0
    with EngineModel(model_dir, spec, out_path) as eng:
        setup = eng.setup
        bar = tqdm(streams, desc=f"engine {name}", unit="stream", disable=not opts.progress)
        for stream, rows in bar:
            rows = rows.head(opts.max_tokens) if opts.max_tokens else rows
            r = decode_stream(setup, eng.engine, rows["token_id"].to_numpy())
            admissions += r["admissions"]
            admit_wait_s += float(r["admit_wait_s"].sum())
            frames.append(
                pl.DataFrame(
                    {
                        "stream": np.full(len(rows), stream, np.int32),
                        "pos": rows["pos"].to_numpy().astype(np.int32),
                        "wall_s": r["wall_s"],
                        "fetch_wait_s": r["fetch_wait_s"],
                        "bytes_sync": r["bytes_sync"],
                        "bytes_bg": r["bytes_bg"],
                        **{
                            n: r["counts"][:, i].astype(np.int32)
                            for i, n in enumerate(("hit", "fetch", "sub", "host", "forced"))
                        },  # fmt: skip
                        "nll": r["nll"],
                        "mass": r["mass"],
                    }
                ).with_columns(pl.col("nll").fill_nan(None))
            )
    out = pl.concat(frames)
    nll = out["nll"].fill_null(np.nan).to_numpy()
    meta = {
        "policy": spec.policy_meta,
        "name": name,
        "fraction": spec.fraction,
        "capacity": int(spec.capacity),
        "device": str(setup.device),
        "tier": setup.tier.description,
        "tier_kind": setup.tier.kind,
        "expert_bytes": int(setup.expert_bytes),
        "core_build_id": CORE_BUILD_ID,
        "num_layers": setup.info.num_layers,
        "dtype": opts.dtype,
        "admission": opts.admission,
        "admit_wait_s": admit_wait_s,  # blocked on due admissions (admission="delay" only)
        "summary": summary(out["wall_s"].to_numpy(), nll),
        "admissions_installed": int(out["bytes_bg"].sum() // max(setup.expert_bytes, 1)),
    }
    if setup.bandwidth:
        meta.update(setup.bandwidth)
    if opts.cost_path:
        meta.update(simulator_estimate(out, opts.cost_path, setup.info.num_layers, admissions))
    return write_parquet(out, out_path, metadata=meta)


def simulator_estimate(
    rows: pl.DataFrame, cost_path: str | os.PathLike, num_layers: int, admissions: int
) -> dict[str, float]:
    """The simulator's cost-model time per token for this run's counts, and its relative error
    against the measured mean time per token."""
    import json

    from moesub.engine.calibrate import predicted_time_per_token

    cost = json.loads(_require_file(cost_path, "params.cost_path").read_text())
    counts = {c: int(rows[c].sum()) for c in ("hit", "fetch", "sub", "host", "forced")}
    counts.update(tokens=rows.height * num_layers, admissions=admissions)
    est = predicted_time_per_token(cost, counts, num_layers)
    mean = float(rows["wall_s"].mean())
    return {"est_time_per_token_s": est, "sim_rel_error": (est - mean) / mean}


def summarize_engine(
    paths: Mapping[str, str | os.PathLike],
    baseline: str = "fetch_every_miss",
    host_baseline: str = "host_compute",
) -> pl.DataFrame:
    """Per-policy summary over engine outputs `{name: path}` (same model, device, streams):
    median / p90 time per token, speedup vs `baseline` and `host_baseline` (median time ratio),
    perplexity and Δppl % vs `baseline`."""
    rows = []
    for name, path in paths.items():
        df = pl.read_parquet(_require_file(path, f"paths[{name!r}]"))
        nll = df["nll"].drop_nulls().to_numpy()
        wall = df["wall_s"].to_numpy()
        rows.append(
            {
                "policy": name,
                "tokens": df.height,
                "time_per_token_median_s": float(np.median(wall)),
                "time_per_token_p90_s": float(np.percentile(wall, 90)),
                "fetch_wait_s": float(df["fetch_wait_s"].mean()),
                "ppl": float(np.exp(nll.mean())),
            }
        )
    from moesub.stats.quality import dppl_pct, speedup  # the project's one Δppl and speedup

    out = pl.DataFrame(rows)
    by = {r["policy"]: r for r in rows}
    times = out["time_per_token_median_s"].to_numpy()
    for col, base in (
        ("speedup_vs_fetch_every_miss", baseline),
        ("speedup_vs_host_compute", host_baseline),
    ):
        ref = by.get(base, {}).get("time_per_token_median_s", np.nan)
        out = out.with_columns(pl.Series(col, speedup(ref, times), dtype=pl.Float64))
    ref_nll = np.log(by[baseline]["ppl"]) if baseline in by else np.nan
    dppl = dppl_pct(np.log(out["ppl"].to_numpy()) - ref_nll)
    return out.with_columns(pl.Series("dppl_pct_vs_fetch_every_miss", dppl, dtype=pl.Float64))
