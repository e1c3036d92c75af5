"""The real offloading engine (stage 5): experts really copied, substituted, admitted.

- `store`: the disk tier's expert file (written once, read with O_DIRECT / posix_fadvise).
- `cache`: fast-tier slot buffers and the two tiers (`DiskTier` disk->RAM, `CudaTier`
  pinned host->GPU with a side stream for admissions).
- `runtime`: `OffloadEngine`, the per-layer driver of the one policy core.
- `decode`: KV-cache decoding of a real model, one token per step: `run_engine` (teacher
  forced, NLL) and `generate` / `open_engine` (free-running greedy generation).
- `bench`: `run_benchmark`, real expert sizes driven by synthetic routing.
- `calibrate`: `calibrate`, the simulator's cost-model figures measured on this machine.
"""

from moesub.engine.bench import BenchParams, run_benchmark
from moesub.engine.calibrate import calibrate
from moesub.engine.decode import (
    ALL_RESIDENT,
    EngineDecodeResult,
    EngineModel,
    EngineParams,
    generate,
    open_engine,
    run_engine,
    summarize_engine,
)
from moesub.engine.store import ExpertStore, StoreLayout, measure_read_bandwidth, write_store

__all__ = [
    "ALL_RESIDENT",
    "BenchParams",
    "EngineDecodeResult",
    "EngineModel",
    "EngineParams",
    "ExpertStore",
    "StoreLayout",
    "calibrate",
    "generate",
    "measure_read_bandwidth",
    "open_engine",
    "run_benchmark",
    "run_engine",
    "summarize_engine",
    "write_store",
]
