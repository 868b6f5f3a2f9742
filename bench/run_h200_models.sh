#!/usr/bin/env bash
# Issue 13 on the H200: `check exact --model DIR` (a checkpoint's real weights, experts and KV moved between
# tiers, compared bit for bit) on every tiny transformers-saved family checkpoint. Build the checkpoints here
# (the device's transformers is another version) and carry them:
#   echo /.models/ >> .git/info/exclude
#   PYTHONPATH=$PWD .venv/bin/python -m tests.runtime.pretrained.hf_tiny .models
# then, through the device tool with carry [".whl", ".models"]:  bash bench/run_h200_models.sh "$OUT" [mode]
set -uo pipefail
out=${1:-bench/results}
# eager: a tiny checkpoint's 3 live-routed prompts can need more experts than F=0.25 leaves slots, which
# the piecewise executor refuses (check exact then says its mode was not exercised)
mode=${2:-eager}
source bench/h200_env.sh  # carried pydantic wheels (the CLI imports it)
for d in .models/*/; do
  name=$(basename "$d")
  timeout 120 python3 -m tierplan.api.cli check exact --model "$d" --device cuda --resident-frac 0.25 --mode "$mode" \
    > "$out/exact_model_$name.log" 2>&1
  echo "== $name rc=$?: $(tail -n 2 "$out/exact_model_$name.log" | tr '\n' ' ')"
done
