"""The real-size benchmark's inputs: router logits (a captured trace mapped onto its shape,
or synthetic routing, `moesub.synthetic`).

Mapping of a captured trace (`map_trace`; logits of shape (T, L_trace, E_trace)) onto a
benchmark of L layers and E experts:

- tokens: the trace's streams concatenated in stream order (the benchmark's caches do not
  restart between streams);
- layers: benchmark layer l replays trace layer `l mod L_trace` (layer to layer; with more
  benchmark layers than captured ones the layers repeat in order);
- experts: benchmark expert e gets the largest logit of the trace experts `e' = e (mod E)`
  (identity when E = E_trace; E > E_trace is refused: the extra experts would never be routed).

The benchmark's tokens (`bench_logits`) come in three disjoint parts, in this order: the tokens
the frequency-initial resident set is counted on (`calib_tokens`), the validation runs' tokens
(`warmup + tokens`) and the calibration runs' tokens (`cal_tokens`). From a capture, the first
part comes from the calibration split (`calib_router.parquet`), the others from the evaluation
split (`eval_router.parquet`), validation first.

Also the benchmark's other inputs: the frequency-initial set, the random experts of the CUDA
tier's pinned copy, and the resource checks made before any work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moesub.engine.store import StoreLayout
from moesub.policy import ALL_RESIDENT

ROUTING = ("trace", "synthetic")
TRACE_FILES = ("calib_router.parquet", "eval_router.parquet")


def map_trace(logits: np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:
    """(T, L_trace, E_trace) -> (T, num_layers, num_experts) float32 (the module's mapping)."""
    logits = np.asarray(logits, dtype=np.float32)
    if logits.ndim != 3:
        raise ValueError(f"router trace: expected (T, L, E) logits, got shape {logits.shape}")
    _T, Lt, Et = logits.shape
    if num_experts > Et:
        raise ValueError(
            f"benchmark num_experts={num_experts} > the trace's {Et} experts: experts "
            f"{Et}..{num_experts - 1} would never be routed (use num_experts <= {Et})"
        )
    layers = logits[:, [layer % Lt for layer in range(num_layers)]]
    pad = -Et % num_experts  # residue classes of unequal size: pad with -inf, never the max
    if pad:
        fill = np.full((*layers.shape[:2], pad), -np.inf, np.float32)
        layers = np.concatenate([layers, fill], axis=2)
    folded = layers.reshape(*layers.shape[:2], -1, num_experts).max(axis=2)
    return np.ascontiguousarray(folded, dtype=np.float32)


@dataclass(frozen=True)
class BenchLogits:
    """The benchmark's router logits, (T, L, E) float32 each."""

    initial: np.ndarray  # the frequency-initial set is counted on these
    validation: np.ndarray  # the measured policies' runs (warmup first)
    calibration: np.ndarray  # the cost-model calibration runs (warmup first)
    source: str  # where they came from, in words


def _concat_trace(path: Path) -> tuple[np.ndarray, int]:
    from moesub.artefacts import load_trace

    trace = load_trace(path)
    return np.concatenate(trace.logits, axis=0), len(trace.logits)


def bench_logits(
    routing: str,
    layers: int,
    num_experts: int,
    calib_tokens: int,
    validation_tokens: int,
    calibration_tokens: int,
    seed: int,
    trace_dir: str | os.PathLike | None = None,
) -> BenchLogits:
    """The three token ranges (module docstring) from synthetic routing or the capture in
    `trace_dir` (its `calib_router.parquet` and `eval_router.parquet`)."""
    if routing not in ROUTING:
        raise ValueError(f"engine bench routing={routing!r}: expected one of {ROUTING}")
    V, C = validation_tokens, calibration_tokens
    if routing == "synthetic":
        from moesub.synthetic import synthetic_logits

        z = synthetic_logits(calib_tokens + V + C, layers, num_experts, seed=seed)
        a, b = calib_tokens, calib_tokens + V
        return BenchLogits(z[:a], z[a:b], z[b:], f"synthetic (moesub.synthetic, seed {seed})")
    if trace_dir is None:
        raise ValueError("engine bench routing='trace' needs trace_dir (a capture directory)")
    paths = [Path(trace_dir) / name for name in TRACE_FILES]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"engine bench routing='trace': {p} does not exist")
    calib, n_calib = _concat_trace(paths[0])
    evals, n_eval = _concat_trace(paths[1])
    if len(calib) < calib_tokens or len(evals) < V + C:
        raise ValueError(
            f"engine bench routing='trace': {trace_dir} holds {len(calib)} calibration and "
            f"{len(evals)} evaluation tokens; the benchmark needs {calib_tokens} and {V + C} "
            "(lower calib_tokens, tokens or warmup)"
        )
    return BenchLogits(
        map_trace(calib[:calib_tokens], layers, num_experts),
        map_trace(evals[:V], layers, num_experts),
        map_trace(evals[V : V + C], layers, num_experts),
        f"captured trace {trace_dir} ({n_calib} calibration + {n_eval} evaluation streams, "
        f"streams concatenated; layer l <- trace layer l mod L, expert e <- max over trace "
        f"experts = e mod {num_experts})",
    )


def frequency_initial(logits: np.ndarray, k: int, capacity: int) -> np.ndarray:
    """(L, C): per layer the C experts most often in the top-k of `logits` (T, L, E), ties to
    the lower id (the capture stage's frequency-initial rule)."""
    from moesub.artefacts import frequency_sets, topk_mask

    return frequency_sets(topk_mask(logits, k).sum(axis=0), capacity)


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def random_fill(lay: StoreLayout, seed: int, dev: torch.device):
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


def check_resources(p, dev: torch.device, out_path: Path) -> Path:  # p: BenchParams
    """Host memory and disk space checked before any work; returns the expert file's path."""
    lay, E, C, L = p.layout(), p.num_experts, p.capacity, p.layers
    # a run's slots (C), all_resident's (all E experts per layer, kept across its rounds) beside
    # them, and the initial set's image (C)
    need_ram = L * lay.expert_bytes * ((E if ALL_RESIDENT in p.policies else 0) + 2 * C)
    if dev.type == "cuda":
        need_ram = L * E * lay.expert_bytes  # pinned host copy of every expert
    avail = mem_available()
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
    return store_path
