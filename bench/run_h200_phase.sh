#!/usr/bin/env bash
# One chunk of the phase sweep on the lent H200 (issue 14; bench/results/phase_h200.md), sent through the device
# tool from the repo root, carrying .whl (pydantic wheels: see bench/h200_env.sh):
#   bash bench/run_h200_phase.sh "$OUT" POINTS [MODEL] [SECONDS] [EXTRA...]
# e.g. bash bench/run_h200_phase.sh "$OUT" b8c1024g40,b32c1024g40 qwen3-30b-a3b 520
# The model's newest merged JSON in bench/results is copied into $OUT under today's name first, so this call's
# rows merge into it and the runs this code already measured on this device are skipped (a chunk cut off by its
# timeout resumes where it stopped; EXTRA may be --fresh to measure them again). Copy $OUT's JSON, Markdown and
# PNGs back into bench/results after the call, and the raw files into bench/results/h200/phase_runNN/.
set -uo pipefail
out=${1:?usage: run_h200_phase.sh OUT POINTS [MODEL] [SECONDS] [EXTRA...]}
points=${2:?usage: run_h200_phase.sh OUT POINTS [MODEL] [SECONDS] [EXTRA...]}
model=${3:-qwen3-30b-a3b}
secs=${4:-520}
shift $(( $# < 4 ? $# : 4 ))
steps=none
source bench/h200_env.sh
last=$(ls bench/results/phase_"$model"_*.json 2>/dev/null | sort | tail -n 1)
if [ -n "$last" ]; then
  cp "$last" "$out/phase_${model}_$(date +%Y%m%d).json"
  echo "== merging into the rows of $last"
fi
{ git log -1 --format=%h; git status --short; } > "$out/commit.txt" 2>&1
step "$secs" phase.log python3 -m tierplan.api.cli bench phase --device cuda --models "$model" --points "$points" \
  --policies tierplan,kv_tiering,static_lru,resident,oracle,static_lfru,fluxmoe,mv_wsa --out-dir "$out" "$@"
grep "tok/s" "$out/phase.log" | cut -c1-110
md=$(ls "$out"/phase_"$model"_*.md 2>/dev/null | tail -n 1)
[ -n "$md" ] && sed -n '/^## Targets/,/^## Every run/p' "$md" | cut -c1-300
exit 0
