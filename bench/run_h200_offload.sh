#!/usr/bin/env bash
# The H200 run for issue 12 (offload_h200.md), sent through the device tool from the repo root:
#   bash bench/run_h200_offload.sh "$OUT" [steps]
# steps: comma-separated subset of pytest,exact,offload (all by default). Carry .whl (pydantic wheels: see
# bench/h200_env.sh). OFFLOAD_ARGS: more arguments for bench offload (e.g. "--models qwen3-30b-a3b"). The pytest
# step collects the GPU modules whose imports the device image has (no cvxpy/HiGHS or LightGBM there).
set -uo pipefail
out=${1:-bench/results}
steps=${2:-pytest,exact,offload}
source bench/h200_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv \
  > "$out/machine.log" 2>&1; python3 -c 'import torch; print(torch.__version__)' >> "$out/machine.log" 2>&1
want pytest && step 240 pytest_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider tests/agent/test_budgets.py \
  tests/runtime/test_gpu.py tests/runtime/test_kv.py
want exact && step 200 exact_qwen3_2L.log python3 -m tierplan.api.cli check exact --preset qwen3-30b-a3b --layers 2 \
  --resident-frac 0.25 --device cuda --mode all
want exact && step 230 exact_qwen3_2L_pinned.log python3 -m tierplan.api.cli check exact --preset qwen3-30b-a3b \
  --layers 2 --resident-frac 0.25 --device cuda --mode all --expert-store pinned
want exact && step 330 exact_mixtral_2L.log python3 -m tierplan.api.cli check exact --preset mixtral-8x7b --layers 2 \
  --resident-frac 0.5 --device cuda --mode all
# shellcheck disable=SC2086  # OFFLOAD_ARGS is split into words on purpose
want offload && step 420 bench_offload.log python3 -m tierplan.api.cli bench offload --device cuda --out-dir "$out" \
  ${OFFLOAD_ARGS:-}
grep -h "exact:\|mode=" "$out"/exact_*.log 2>/dev/null | cut -c1-200
[ -f "$out/offload_cuda.md" ] && cut -c1-220 "$out/offload_cuda.md"
exit 0
