#!/usr/bin/env bash
# Install moesub and its dependencies into a virtual environment (default .venv).
# torch is installed first and pinned to the CPU build where one is provided locally, so that
# resolving `torch>=2.4` does not pull a multi-GB CUDA build; a user with a CUDA torch already
# in the environment keeps it (the requirement is a range). Everything else is installed at the
# versions in constraints.txt.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
# the versions the suite and the default run were checked with (scripts/freeze_constraints.sh);
# MOESUB_CONSTRAINTS= resolves the newest that pyproject.toml's ranges allow instead
CONSTRAINTS=${MOESUB_CONSTRAINTS-constraints.txt}
PINNED=()
[ -z "$CONSTRAINTS" ] || PINNED=(-c "$CONSTRAINTS")
$PIP install -q "${PINNED[@]}" scikit-build-core nanobind
$PIP install -q "${PINNED[@]}" --no-build-isolation -e ".[dev]"
"$VENV/bin/python" -c "import moesub.policy as p; print('moesub core', p.CORE_BUILD_ID)"
