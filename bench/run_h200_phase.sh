#!/usr/bin/env bash
# One chunk of the phase sweep on the lent H200 (issue 14; bench/results/phase_h200.md), sent through the device
# tool from the repo root, carrying .whl (pydantic wheels: see bench/h200_env.sh):
#   [GPUS=N] [POLICIES=a,b,...] [GPU_TESTS=all] [PLANNER_CORES=N] bash bench/run_h200_phase.sh "$OUT" POINTS [MODELS] \
#     [SECONDS] [EXTRA...]       (PLANNER_CORES: --planner-cores, the CPUs a live policy's planner process may use)
# e.g. bash bench/run_h200_phase.sh "$OUT" b8c1024g40,b32c1024g40 qwen3-30b-a3b 520
#      bash bench/run_h200_phase.sh "$OUT" b1,b8,b32,b128,b256 qwen3-30b-a3b,mixtral-8x7b 570 --unmeasured
#        (the points this device has no row at yet, in grid order, as many as the deadline lets start)
#      GPUS=2 bash bench/run_h200_phase.sh "$OUT" qwen3-30b-a3b:b32c1024g56,mixtral-8x7b:b1c1024g32 \
#        qwen3-30b-a3b,mixtral-8x7b 520          (nvidia-h200-x2: a worker per GPU, each claims the next point)
# Each model's newest merged JSON in bench/results is copied into $OUT under today's name first, so this call's
# rows merge into it and the runs this code already measured on this device are skipped (a chunk cut off by its
# timeout resumes where it stopped; EXTRA may be --fresh to measure them again). A sweep cut off by SECONDS still
# gets its report, from the rows it finished; a point whose runs would not end in time by the rows of the nearest
# point measured before (bench/phase_timing.py) is not started (--deadline-s, 20 s inside SECONDS). Every run's
# steps are kept too (--save-steps: bench/phase_steps.py), phase_<model>_<date>_steps_<run id>.jsonl.gz, for
# offline study of the cost model. After the call: unpack $OUT/phase_out.tgz into
# bench/results/h200/phase_runNN/ and merge its JSON into bench/results (rows once each, the report rewritten):
#   tierplan bench phase --merge bench/results/h200/phase_runNN/phase_<model>_<date>.json
# then gzip -9 -n that run's JSON and delete the run's PNGs (the merged file holds its rows, and its report draws
# them again; the device tool sends the working tree, tracked files included, 64 MiB at most: the per-run copies
# of the merged JSON passed it in session 29, the per-run plots, 15.9 MB, were removed in session 31, and since
# session 39 a run's copy holds only the rows that call added; runs 01-77 were cut to theirs, 19.2 -> 0.9 MB).
set -uo pipefail
out=${1:?usage: run_h200_phase.sh OUT POINTS [MODELS] [SECONDS] [EXTRA...]}
points=${2:?usage: run_h200_phase.sh OUT POINTS [MODELS] [SECONDS] [EXTRA...]}
models=${3:-qwen3-30b-a3b}
secs=${4:-520}
gpus=${GPUS:-1}
shift $(( $# < 4 ? $# : 4 ))
steps=none
source bench/h200_env.sh
for model in ${models//,/ }; do
  last=$(ls bench/results/phase_"$model"_*.json 2>/dev/null | sort | tail -n 1)
  if [ -n "$last" ]; then
    cp "$last" "$out/phase_${model}_$(date +%Y%m%d).json"
    echo "== merging into the rows of $last"
  fi
done
# lscpu -e: which CPUs share a core (a planner confined to the last --planner-cores CPUs may share the engine's)
{ git log -1 --format=%h; git status --short; nvidia-smi -L; nvidia-smi topo -m; lscpu -e; } > "$out/commit.txt" 2>&1
# The KV tiers' device tests first (moves one by one and as lists, after the compute stream's writes) and the
# engine's exact check with KV spilled every step: out of this call's SECONDS, so every sweep call also checks the
# mechanism its runs move KV blocks with, bit for bit.
# GPU_TESTS=all: every GPU test instead (after a change to the engine's device code, one call checks it too).
t0=$SECONDS
if [ "${GPU_TESTS:-}" = all ]; then
  # The files that hold GPU tests, not the whole tree: the api tests import fastapi and SQLAlchemy, which the device
  # lacks, and one collection error stops every test.
  step 300 pytest_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider \
    $(grep -rl --include='test_*.py' 'mark.gpu' tests)
else
  step 150 pytest_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_kv.py \
    tests/runtime/test_gpu.py -k "kv or (engine_exact_on_cuda_with_the_paged_kernel and beside_copy-False-issued)"
fi
secs=$(( secs - (SECONDS - t0) ))  # a failed device test shows in pytest_gpu.log and the output; the sweep still runs
secs=$(( secs > 60 ? secs : 60 ))
step "$secs" phase.log python3 -m tierplan.api.cli bench phase --device cuda --gpus "$gpus" --models "$models" \
  --points "$points" --policies "${POLICIES:-tierplan,kv_tiering,static_lru,resident,oracle,static_lfru,fluxmoe,mv_wsa}" \
  --out-dir "$out" --save-steps ${PLANNER_CORES:+--planner-cores "$PLANNER_CORES"} --deadline-s $(( secs > 40 ? secs - 20 : secs )) "$@"
if ! ls "$out"/phase_*.md >/dev/null 2>&1 || [ "$(tail -n 1 "$out/phase.log" | grep -c 'rows in\|report from')" = 0 ]; then
  # cut off by the timeout (its workers with it: timeout signals the whole process group): report what finished
  python3 - "$out" "$models" <<'PY'
import sys, time
from pathlib import Path
from tierplan.bench.phase import sweep_grid, write_reports
sizes, _ = sweep_grid(models=tuple(sys.argv[2].split(",")))
print(write_reports(Path(sys.argv[1]), sys.argv[2].split(","), sizes, time.strftime("%Y%m%d")))
PY
fi
cat "$out"/phase.log "$out"/phase_worker*.log 2>/dev/null | grep "tok/s" | cut -c1-110
for md in "$out"/phase_*.md; do
  [ -f "$md" ] && { echo "== $md"; sed -n '/^## Targets/,/^## Every run/p' "$md" | cut -c1-300; }
done
# The call's copy keeps only the rows it added to the file it started from (its reports above read them all): the
# merge appends what bench/results lacks either way, and a copy of the whole merged file per run had put 19 MB of
# repeats in the tree by run 77, which the device tool sends with every call (64 MiB at most).
for model in ${models//,/ }; do
  last=$(ls bench/results/phase_"$model"_*.json 2>/dev/null | sort | tail -n 1)
  [ -n "$last" ] && python3 - "$last" "$out/phase_${model}_$(date +%Y%m%d).json" <<'PY'
import sys
from pathlib import Path
from tierplan.bench.phase_store import load_rows, row_identity, write_rows
start, copy = Path(sys.argv[1]), Path(sys.argv[2])
if copy.exists():
    had = {row_identity(r) for r in load_rows(start)}
    kept = [r for r in load_rows(copy) if row_identity(r) not in had]
    write_rows(copy, kept)
    print(f"== {copy.name}: the {len(kept)} row(s) this call added kept, the rows it started from left out")
PY
done
# $OUT returns at most 8 files: two models' JSON, Markdown and plots plus the logs are more, so one archive
tar czf /tmp/phase_out.tgz -C "$out" .
if [ "$(stat -c %s /tmp/phase_out.tgz)" -gt $((15 << 20)) ]; then  # the device tool returns files of 16 MiB at most
  echo "== phase_out.tgz over 15 MiB: packed again without the per-step records (the rows are all there)"
  tar czf /tmp/phase_out.tgz -C "$out" --exclude='*_steps_*.jsonl.gz' .
fi
find "$out" -type f -delete && mv /tmp/phase_out.tgz "$out"/
exit 0
