#!/usr/bin/env bash
# Best effort: put the GSM8K test set at data/gsm8k/test.jsonl for the generation stage.
# 1. a local copy ($GSM8K_JSONL, or the workplace's ../shared/data/gsm8k/test.jsonl);
# 2. otherwise `datasets` when online. Without either the pipeline still runs and the report
#    says GSM8K was not evaluated.
set -u
VENV=${1:-.venv}
out=data/gsm8k/test.jsonl
[ -s "$out" ] && exit 0
mkdir -p data/gsm8k
for src in "${GSM8K_JSONL:-}" ../shared/data/gsm8k/test.jsonl; do
  if [ -n "$src" ] && [ -s "$src" ]; then cp "$src" "$out" && echo "GSM8K: copied $src" && exit 0; fi
done
if timeout 120 "$VENV/bin/python" -c "from moesub.generate import fetch_gsm8k; fetch_gsm8k('$out')" 2>/dev/null; then
  echo "GSM8K: fetched with datasets"
else
  echo "GSM8K: no local copy and no network; the report will show it as not evaluated (see data/README.md)"
fi
exit 0
