"""The engine's decode loop over a real model: one token per step with the KV cache.

One loop (`decode_tokens`) serves teacher forcing (the stage's `run_engine`: every stream token
fed, NLL of the next one) and free-running greedy generation (`moesub.engine.generate`: the
prompt fed token by token, then the argmax of each step fed back), from fresh caches every time.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from moesub.engine.adapter import EngineSetup
from moesub.engine.runtime import OffloadEngine
from moesub.engine.token_stats import NUM_FIELDS, SCALAR_STATS, TokenStats
from moesub.models import cached_forward
from moesub.policy import STATUS_NAMES


def step(model: nn.Module, token: int, cache: Any, device: torch.device):
    ids = torch.tensor([[token]], dtype=torch.long, device=device)
    out, cache = cached_forward(model, ids, cache)
    return out.logits[0, -1], cache


@torch.inference_mode()
def decode_tokens(
    setup: EngineSetup,
    engine: OffloadEngine,
    inputs: Sequence[int] | np.ndarray,
    max_new_tokens: int = 0,
    stop_ids: Collection[int] = frozenset(),
    prefill: bool = False,
) -> dict[str, Any]:
    """Decode from fresh caches, one token per step: feed `inputs` (P >= 1 tokens; NLL of each
    next input recorded), then continue greedily for up to `max_new_tokens` tokens (argmax of
    each step's logits fed back; a token in `stop_ids` ends it and is not kept).

    `prefill=True` (generation): the first P - 1 inputs go through the model in one forward,
    their rows through the policy cores one at a time (`OffloadEngine.route_prefill`: the
    decisions of stepping them), their experts computed from the slow tier; that forward's wall
    time is step 0's and steps 1..P-2 are empty. The prompt's last token is a timed step.

    Returns per-step arrays over the S steps run (`wall_s` and every scalar of
    `runtime.TokenStats`: `fetch_wait_s, admit_wait_s, prefetch_wait_s, host_wait_s, bytes_sync,
    bytes_bg, bytes_prefetch, bytes_host, mass, admissions, admitted, admit_latency, prefetches,
    prefetch_in_time, syncs` (S,), `counts` (S, len(STATUS_NAMES)), `layer_counts` (S, L,
    len(TOKEN_LAYER_FIELDS)) what each layer's policy did (zeros for a prefill's rows), `nll`
    (S,) NaN where no input followed), plus `generated` (tokens), `stopped` and `admissions`
    (the total). Generated
    token i came from step P-1+i; the last generated token is never fed (S = P + n - 1, or
    P + n when a stop token ended it). A step's wall time runs from its start (admissions
    installed) to the end of its compute on the device (`OffloadEngine.end_token`: the compute
    stream only) and its values on the host.
    """
    P = len(inputs)
    if P == 0:
        raise ValueError("inputs: decoding needs at least one input token")
    engine.reset(load=not (prefill and P > 1))  # a prefill loads the slots it leaves
    S = P + max(max_new_tokens - 1, 0)  # most steps that can run
    blank = TokenStats()
    cols = {"wall_s": np.zeros(S, np.float64)}
    cols.update({c: np.zeros(S, type(getattr(blank, c))) for c in SCALAR_STATS})
    counts = np.zeros((S, len(STATUS_NAMES)), np.int64)
    layer_counts = np.zeros((S, engine.num_layers, NUM_FIELDS), np.int64)
    nll = np.full(S, np.nan)
    generated: list[int] = []
    stopped = False
    cache, token, t, start = None, int(inputs[0]), 0, 0
    if prefill and P > 1:
        t0 = time.perf_counter()
        engine.begin_token()
        engine.prefilling = True
        ids = torch.tensor([list(inputs[: P - 1])], dtype=torch.long, device=setup.device)
        out, cache = cached_forward(setup.model, ids, None)
        engine.end_prefill()
        engine.end_token()
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # (P - 1, V), as stream_nll
        targets = torch.as_tensor(np.asarray(inputs[1:P]), device=logp.device)
        nll[1:P] = (-logp.gather(1, targets[:, None])[:, 0]).cpu().numpy()
        cols["wall_s"][0] = time.perf_counter() - t0
        token, start = int(inputs[P - 1]), P - 1
    for t in range(start, S):
        t0 = time.perf_counter()
        engine.begin_token()
        logits, cache = step(setup.model, token, cache, setup.device)
        nll_t = next_t = None
        if t + 1 < P:  # teacher forcing: the next input is given
            token = int(inputs[t + 1])
            nll_t = -torch.log_softmax(logits.float(), dim=-1)[token]  # as models.stream_nll
        elif max_new_tokens:  # free running: greedy (ties to the lower id, as torch.argmax)
            next_t = torch.argmax(logits)
        st = engine.end_token()  # the compute stream has finished: the reads below do not wait
        if nll_t is not None:
            nll[t + 1] = float(nll_t)
        if next_t is not None:
            token = int(next_t)
        cols["wall_s"][t] = time.perf_counter() - t0
        for c in SCALAR_STATS:
            cols[c][t] = getattr(st, c)
        counts[t], layer_counts[t] = st.counts, st.layer_counts
        if t + 1 >= P and max_new_tokens:
            if token in stop_ids:
                stopped = True
                break
            generated.append(token)
            if len(generated) == max_new_tokens:
                break
    n = t + 1  # steps run
    out: dict[str, Any] = {c: v[:n] for c, v in cols.items()}
    out.update(counts=counts[:n], layer_counts=layer_counts[:n], nll=nll[:n])
    out.update(generated=generated, stopped=stopped)
    out["admissions"] = int(out["admissions"].sum())  # the total over the decode
    return out
