#!/usr/bin/env bash
# System packages the test suite needs (Debian): headless Chromium for the report test, and
# SLURM + munge for the cluster test. Needs root; skipped (with a note) otherwise.
set -euo pipefail
pkgs=(chromium slurmctld slurmd slurm-client munge util-linux)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "install_system.sh: not root; missing Debian packages: ${missing[*]} (their tests will skip)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
