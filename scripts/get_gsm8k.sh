#!/usr/bin/env bash
# Replace or restore the GSM8K test set at data/gsm8k/test.jsonl (the repository ships it, so
# the pipeline never needs this script). Best effort, in this order:
# 1. a local copy named by $GSM8K_JSONL (replaces the shipped file);
# 2. if the file is absent: `datasets` when online.
# Without either the pipeline still runs and the report says GSM8K was not evaluated.
set -u
VENV=${1:-.venv}
out=data/gsm8k/test.jsonl
mkdir -p data/gsm8k
if [ -n "${GSM8K_JSONL:-}" ]; then
  if [ -s "$GSM8K_JSONL" ]; then
    cp "$GSM8K_JSONL" "$out" && echo "GSM8K: copied $GSM8K_JSONL" && exit 0
  fi
  echo "GSM8K: GSM8K_JSONL=$GSM8K_JSONL is missing or empty" >&2
fi
[ -s "$out" ] && exit 0
if timeout 120 "$VENV/bin/python" -c "from moesub.generate import fetch_gsm8k; fetch_gsm8k('$out')" 2>/dev/null; then
  echo "GSM8K: fetched with datasets"
else
  echo "GSM8K: no local copy and no network; the report will show it as not evaluated (see data/README.md)"
fi
exit 0
