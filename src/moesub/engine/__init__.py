"""The real offloading engine (stage 5): experts really copied, substituted, admitted.

Modules, lowest layer first (each imports only modules above it in this list):

- `contention`: `CpuMeter`, the CPU share a timed run had (`contended` below 0.8).
- `store`: the disk tier's expert file (written once, read with O_DIRECT / posix_fadvise, its
  reads timed: `read_clock`).
- `kernels`: expert compute from slot buffers, planned on the host (grouped matmul where it
  is fast, per-expert matmuls elsewhere).
- `host_memory`: the experts behind the GPU (`HostExperts`: a pinned budget, disk behind it).
- `copies`: `BackgroundCopies`, the ledger of a tier's background copies (in flight, landed,
  the slots awaiting them, waiting on them, the bytes installed), whatever they are for, and
  `COPY_TIMEOUT_S`, the longest a copy is waited for (the tiers' drains too).
- `tiers`: fast-tier slot buffers and the disk tier (`DiskTier`: disk -> RAM; `SlotImage`,
  experts read once that its loads copy); `disk_clock`, what a tier's expert file has read.
- `cuda_tier`: the CUDA tier (`CudaTier`: pinned host memory (or disk) -> GPU, admissions on a
  side stream).
- `microbench`: the fast tier's microbenchmarks that the calibration's fit cannot separate (its
  expert time, its slowdowns while the link reads, its install of a landed copy).
- `token_stats`: `TokenStats`, what one token cost (waits, bytes) and what each layer's policy
  did (per token-layer counts in `TOKEN_LAYER_FIELDS` layout).
- `runtime`: `OffloadEngine`, the per-layer driver of the one policy core.
- `spec`: the `engine:` options (`EngineParams`) and an engine's checked inputs (`EngineSpec`).
- `adapter`: a Hugging Face MoE model whose experts live in a tier (`load_engine_model` once,
  `build_engine_model` per engine).
- `decode`: the KV-cache decode loop, one token per step (teacher forced or greedy).
- `generate`: `EngineModel` (a built engine, reused), `open_engine`, `generate`.
- `calibrate`: `calibrate`, this machine's hardware profile fitted to timed engine runs (one
  mechanism per run, `moesub.calibration`; `Calibration` runs them one at a time).
- `stage`: `run_engine_stage` (the pipeline stage: the calibration and every policy's runs,
  interleaved), `run_engine` (one policy: NLL and time per token) and `summarize_engine`.
- `bench_inputs`: the benchmark's router logits (a captured trace mapped onto its shape, or
  synthetic), its initial set, random experts and resource checks.
- `bench_runs`: one timed run of the engine over router logits (`run_policy`, `BenchRun`) and
  its counts by status name.
- `bench`: `run_benchmark`, real expert sizes driven by a router trace, this machine's profile
  fitted and validated (each policy's own counts priced) in the same run.
"""

from moesub.engine.bench import BenchParams, run_benchmark
from moesub.engine.calibrate import calibrate
from moesub.engine.generate import EngineDecodeResult, EngineModel, generate, open_engine
from moesub.engine.spec import EngineParams
from moesub.engine.stage import run_engine, run_engine_stage, summarize_engine
from moesub.engine.store import ExpertStore, StoreLayout, measure_read_bandwidth, write_store

__all__ = [
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
    "run_engine_stage",
    "summarize_engine",
    "write_store",
]
