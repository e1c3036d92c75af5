#!/usr/bin/env bash
# Write constraints.txt: the exact versions of every distribution in a tested environment
# (default .venv), which scripts/install.sh installs with, so that a fresh clone's `make report`
# trains the embedded model and computes its figures with the same libraries as the run they
# were checked on (a transformers release changed the trained model: docs/measurements.md).
# Run it after upgrading a dependency and passing the suite and the default run with it.
# torch is left out (install.sh pins the CPU build; a CUDA environment keeps its own), and so
# is moesub itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
OUT=constraints.txt
{
  echo "# The versions the suite and the default run were last checked with"
  echo "# (scripts/freeze_constraints.sh; Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'))."
  echo "# scripts/install.sh installs with them; MOESUB_CONSTRAINTS= lifts them."
  "$VENV/bin/python" -m pip freeze --exclude-editable | grep -v -i -E '^(torch|moesub)(==| @)'
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "freeze_constraints: $(grep -c '==' "$OUT") pins -> $OUT"
