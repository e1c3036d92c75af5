"""One timed run of the engine over router logits, as the real-size benchmark makes it
(`moesub.engine.bench`), and what it counted.

`run_policy` drives an `OffloadEngine` token by token over logits (T, L, E): per layer a
real-size router matmul on the fast device whose result reaches the host (the synchronization
a real router imposes), the policy core's step on the given logits, the experts computed from
the slots (and the host's). `BenchRun` holds the per-token wall times and counters;
`by_status` names the status counts, `timed_tokens` gives the cost fit's regressors
(`moesub.calibration`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from moesub.calibration import TimedTokens
from moesub.engine.contention import CpuMeter
from moesub.engine.runtime import HostInputs, OffloadEngine
from moesub.policy import STATUS_NAMES, TOKEN_LAYER_FIELDS


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


@dataclass
class BenchRun:
    """Per measured token (T,) of one run, and two totals."""

    wall_s: np.ndarray
    fetch_wait_s: np.ndarray
    bytes_sync: np.ndarray
    bytes_bg: np.ndarray
    counts: np.ndarray  # (T, S) slots per status code (`STATUS_NAMES` order), all layers
    layer_counts: np.ndarray  # (T, L, len(TOKEN_LAYER_FIELDS)) what the policy did per layer
    admissions: np.ndarray  # (T,) admission requests per token
    syncs: np.ndarray  # (T,) host waits for the device per token
    admitted: int  # background copies installed
    admit_latency: int  # tokens from request to install, summed over those installed
    cpu_share: float  # the run's CPU share (`moesub.engine.contention`)


@torch.inference_mode()
def run_policy(
    engine: OffloadEngine,
    trace: np.ndarray,
    router_w: list[torch.Tensor],
    h0: torch.Tensor,
    warmup: int,
    desc: str,
    progress: bool,
    layers: int | None = None,
) -> BenchRun:
    """Drive the engine over `trace` (T, L, E) (its first `layers` layers, default all); the
    first `warmup` tokens are not recorded."""
    engine.reset()
    T, L, _E = trace.shape
    L = layers or L
    n = T - warmup
    wall, wait = np.zeros(n), np.zeros(n)
    bsync, bbg = np.zeros(n, np.int64), np.zeros(n, np.int64)
    counts = np.zeros((n, len(STATUS_NAMES)), np.int64)
    layer_counts = np.zeros((n, L, len(TOKEN_LAYER_FIELDS)), np.int64)
    syncs, admissions = np.zeros(n, np.int64), np.zeros(n, np.int64)
    admitted = admit_latency = 0
    meter = CpuMeter().start()
    for t in tqdm(range(T), desc=desc, unit="tok", disable=not progress, leave=False):
        t0 = time.perf_counter()
        engine.begin_token()
        hidden = h0  # (1, H) every token enters with the same hidden state
        for layer in range(L):
            x = rms_norm(hidden)
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
            layer_counts[i] = st.layer_counts[:L]
            admissions[i] = st.admissions
            admitted += st.admitted
            admit_latency += st.admit_latency
    share = meter.stop()["cpu_share"]
    if not torch.isfinite(hidden.float()).all():
        raise RuntimeError("benchmark hidden state became non-finite")
    return BenchRun(
        wall, wait, bsync, bbg, counts, layer_counts, admissions, syncs, admitted, admit_latency,
        share,
    )  # fmt: skip


def concat_runs(runs: list[BenchRun]) -> BenchRun:
    return BenchRun(
        wall_s=np.concatenate([r.wall_s for r in runs]),
        fetch_wait_s=np.concatenate([r.fetch_wait_s for r in runs]),
        bytes_sync=np.concatenate([r.bytes_sync for r in runs]),
        bytes_bg=np.concatenate([r.bytes_bg for r in runs]),
        counts=np.concatenate([r.counts for r in runs]),
        layer_counts=np.concatenate([r.layer_counts for r in runs]),
        admissions=np.concatenate([r.admissions for r in runs]),
        syncs=np.concatenate([r.syncs for r in runs]),
        admitted=sum(r.admitted for r in runs),
        admit_latency=sum(r.admit_latency for r in runs),
        cpu_share=float(np.median([r.cpu_share for r in runs])),
    )


def hits_only(logits: np.ndarray, initial: np.ndarray) -> np.ndarray:
    """`logits` (T, L, E) with every expert outside the layer's resident set `initial` (L, C)
    pushed down so far that it is never selected: a fetch_all run is then all hits."""
    out = logits.copy()
    for layer in range(out.shape[1]):
        mask = np.ones(out.shape[2], bool)
        mask[initial[layer]] = False
        out[:, layer, mask] -= 1e4
    return out


def by_status(counts: np.ndarray) -> dict[str, np.ndarray]:
    """Counts (..., S) in `STATUS_NAMES` order -> {status name: counts (...)}."""
    return dict(zip(STATUS_NAMES, np.moveaxis(counts, -1, 0), strict=True))


def timed_tokens(r: BenchRun) -> TimedTokens:
    return TimedTokens.from_counts(r.wall_s, r.layer_counts)
