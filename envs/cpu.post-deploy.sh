#!/usr/bin/env bash
# Snakemake runs this once after creating the conda environment (activated), in the workflow's
# working directory (the moesub checkout): install moesub and build its C++ core there.
set -euo pipefail
python -m pip install --no-deps --no-build-isolation "${MOESUB_SOURCE:-.}"
