#!/usr/bin/env bash
# GPU check of the offloading engine (issue 5): build, the CUDA engine tests, and the real-size
# benchmark on the pinned-host -> GPU tier; prints the figures. Budget: under 5 minutes.
#
#   bash scripts/device_check.sh            # from the repository root, on a CUDA machine
#   OUT=/some/dir LAYERS=4 TOKENS=128 bash scripts/device_check.sh
#
# Needs python with torch (CUDA build), transformers, polars, pyarrow, pytest; the C++ policy
# core is built offline from this checkout if `moesub._core` does not import (scikit-build-core,
# nanobind, cmake and a C++17 compiler must then be installed). Nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/moesub_device_check}
LAYERS=${LAYERS:-4}
TOKENS=${TOKENS:-128}
mkdir -p "$OUT"
t0=$(date +%s)
stage() { echo; echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

stage "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if not torch.cuda.is_available():
    raise SystemExit("device_check: no CUDA device visible to torch; nothing to check")
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PYEOF

stage "build"
if ! "$PY" -c "import moesub._core, moesub.engine" 2>/dev/null; then
  "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -3
fi
"$PY" -c "import moesub.engine, moesub.policy as p; print('moesub core', p.CORE_BUILD_ID)"

stage "CUDA engine tests (pytest -m cuda)"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_engine.py

stage "real-size benchmark, pinned host -> GPU (Qwen3-Next-80B-A3B experts, C=128 of 512)"
timeout 150 "$PY" benchmarks/bench_engine.py --device cuda --layers "$LAYERS" --tokens "$TOKENS" \
  --warmup 16 --rounds 2 --quiet --out "$OUT/engine_bench_cuda.parquet"

stage "done"
