"""Generation on the offloading engine, and the built engine every decode runs on.

`EngineModel` is a model built once for the engine under one policy (`build_engine_model` on a
model loaded here, or shared by a job running many engines: `load_engine_model`; the policy
cores, the router hook) and reused for any number of streams (`decode`, the stage's teacher
forcing) or prompts (`generate`, free-running greedy). `open_engine` builds one from
checked inputs; `generate` is the engine's counterpart of `moesub.greedy.greedy_decode`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moesub.engine.adapter import (
    EngineRouter,
    LoadedModel,
    PrefetchHook,
    build_engine_model,
    load_engine_model,
)
from moesub.engine.decode import decode_tokens
from moesub.engine.runtime import OffloadEngine
from moesub.engine.spec import EngineSpec, resolve_engine
from moesub.engine.token_stats import SCALAR_STATS, TokenStats
from moesub.models import RouterHook
from moesub.policy import STATUS_NAMES, Policy

STEP_COLUMNS = tuple(c for c in SCALAR_STATS if c not in ("mass", "admissions"))


@dataclass
class EngineDecodeResult:
    """One greedy continuation on the engine: `tokens`, `mass`, `stopped` as
    `moesub.greedy.DecodeResult`; per generated token i, what the step that produced it cost
    (the step that fed the prompt's last token for i = 0)."""

    tokens: list[int]  # generated tokens, stop token excluded
    mass: list[float]  # substituted gate mass, summed over layers
    stopped: bool  # a stop token ended it (before max_new_tokens)
    wall_s: np.ndarray  # float64 (n,) synchronized wall time of the step
    counts: np.ndarray  # int64 (n, S) slots per status code (`STATUS_NAMES` order), all layers
    prompt_tokens: int  # P
    prompt_wall_s: float  # wall time of the P - 1 prompt steps that produced no token
    admissions: int  # admission requests over the whole decode
    # per generated token, every scalar of `runtime.TokenStats` but mass and admissions (n,):
    # fetch_wait_s, admit_wait_s, prefetch_wait_s, host_wait_s, bytes_sync, bytes_bg,
    # bytes_prefetch, bytes_host, admitted, admit_latency, prefetches, prefetch_in_time, syncs
    steps: dict[str, np.ndarray]

    @classmethod
    def from_steps(cls, r: dict[str, Any], prompt_tokens: int) -> EngineDecodeResult:
        """From `decode_tokens`' result (no step run: nothing generated, zero-length arrays)."""
        n = len(r["generated"])
        gen = slice(prompt_tokens - 1, prompt_tokens - 1 + n)  # steps that produced a token
        return cls(
            tokens=list(r["generated"]),
            mass=r["mass"][gen].tolist(),
            stopped=bool(r["stopped"]),
            wall_s=r["wall_s"][gen],
            counts=r["counts"][gen],
            prompt_tokens=prompt_tokens,
            prompt_wall_s=float(r["wall_s"][: prompt_tokens - 1].sum()),
            admissions=int(r["admissions"]),
            steps={c: r[c][gen] for c in STEP_COLUMNS},
        )

    @classmethod
    def empty(cls, prompt_tokens: int) -> EngineDecodeResult:
        """Nothing generated and no step run (max_new_tokens = 0)."""
        blank = TokenStats()
        r = {c: np.zeros(0, type(getattr(blank, c))) for c in SCALAR_STATS}
        r.update(wall_s=np.zeros(0), counts=np.zeros((0, len(STATUS_NAMES)), np.int64))
        r.update(generated=[], stopped=False, admissions=0)
        return cls.from_steps(r, prompt_tokens)


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


def check_generation(max_new_tokens: Any, stop_ids: Any) -> frozenset[int]:
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

    def __init__(
        self, model_dir: str | os.PathLike, spec: EngineSpec, loaded: LoadedModel | None = None
    ) -> None:
        self.spec = spec
        # a model loaded here is this engine's; one passed in is shared and stays open
        self._owned = None if loaded is not None else load_engine_model(
            model_dir, str(spec.device), spec.opts, spec.slots, measure_bandwidth=True
        )  # fmt: skip
        try:
            self.setup = build_engine_model(
                loaded or self._owned, str(spec.device), spec.opts, spec.slots,
                prefetch=spec.policy.prefetch,
            )  # fmt: skip
        except BaseException:
            self._close_owned()
            raise
        info = self.setup.info
        try:
            self.engine = OffloadEngine(
                self.setup.tier, info.num_experts, info.top_k, spec.slots, spec.policy,
                spec.initial, self.setup.act, admission=spec.opts.admission,
            )  # fmt: skip
        except BaseException:
            self.setup.tier.close()
            self._close_owned()
            raise
        for m in self.setup.experts:
            m.engine = self.engine
        self._router = EngineRouter(self.engine, self.setup)
        if spec.policy.prefetch > 0:  # lookahead computed one MoE layer early, copies issued
            self._hook = PrefetchHook(
                self.setup.model, self._router, self.engine, self.setup.device
            )
        else:
            self._hook = RouterHook(self.setup.model, self._router)
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
        prefill: bool = False,
    ) -> dict[str, Any]:
        """`decode_tokens` on this engine (per-step measurements; see there)."""
        if self.closed:
            raise RuntimeError("this EngineModel is closed")
        return decode_tokens(self.setup, self.engine, inputs, max_new_tokens, stop_ids, prefill)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_ids: Iterable[int] = (),
        progress: bool | None = None,
    ) -> list[EngineDecodeResult]:
        """Greedy generation, one prompt at a time: the prompt prefilled (all but its last token
        in one forward, `decode_tokens(prefill=True)`), then up to
        `max_new_tokens` tokens, each the argmax of the step before. Every input is checked
        before the first prompt runs."""
        stop = check_generation(max_new_tokens, stop_ids)
        prompts = check_prompts(prompts, self.vocab_size)
        progress = self.spec.opts.progress if progress is None else progress
        results = []
        for prompt in tqdm(
            prompts, desc=f"engine generate {self.spec.name}", unit="prompt", disable=not progress
        ):
            if max_new_tokens == 0:  # nothing to generate: no step runs (as greedy_decode)
                results.append(EngineDecodeResult.empty(len(prompt)))
                continue
            r = self.decode(prompt, max_new_tokens, stop, prefill=True)
            results.append(EngineDecodeResult.from_steps(r, len(prompt)))
        return results

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hook.__exit__(None, None, None)
            self._router.close()
            self.engine.close()
            self._close_owned()

    def _close_owned(self) -> None:
        if self._owned is not None:
            self._owned.close()

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
    `moesub.greedy.greedy_decode`; with params `admission="delay"` the same tokens).

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
    check_generation(max_new_tokens, stop_ids)
    check_prompts(prompts, spec.info.vocab_size)
    with EngineModel(model, spec) as eng:
        return eng.generate(prompts, max_new_tokens, stop_ids, progress)
