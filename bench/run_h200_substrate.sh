#!/usr/bin/env bash
# The exact H200 run behind bench/results/substrate_h200.md, sent through the device tool from the repo root:
#   bash bench/run_h200_substrate.sh "$OUT" 1000000 8
# Arguments: output folder, moves for `check tiers`, processes to shard them over.
set -uo pipefail
out=${1:-bench/results}; moves=${2:-1000000}; jobs=${3:-8}; remaps=${4:-20000}
source bench/h200_env.sh  # carried pydantic wheels (the CLI imports it), step
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  df -h "$TIERPLAN_SCRATCH" | tail -1; nproc; } 2>&1 | tee "$out/env.txt"
step 180 pytest_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/runtime  # the wheels above: agent taps import pydantic
step 180 check_slots.log python3 -m tierplan.api.cli check slots --remaps "$remaps" --seed 1 --device cuda
step 480 check_tiers.log python3 -m tierplan.api.cli check tiers --moves "$moves" --seed 1 --device cuda --jobs "$jobs"
step 300 bench.log python3 -m tierplan.api.cli bench substrate --device cuda --out-dir "$out"
