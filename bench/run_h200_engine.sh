#!/usr/bin/env bash
# The H200 run for issue 3 (engine_h200.md), sent through the device tool from the repo root:
#   bash bench/run_h200_engine.sh "$OUT" [steps]
# steps: comma-separated subset of pytest,loads,exact,engine (all by default); SUBSTRATE_ONLY (default
# loads,urgent), LOAD_CONFIGS (default map-in)
# and ENGINE_ONLY (default: every section) narrow the two benches; ENGINE_PROFILE=1 adds --profile. E.g. the mixed
# prefill/decode steps on both decode paths, with the GPU tests first:
#   ENGINE_ONLY=prefill ENGINE_PROFILE=1 bash bench/run_h200_engine.sh "$OUT" pytest,engine
# Carry .whl (pydantic wheels: see bench/h200_env.sh).
set -uo pipefail
out=${1:-bench/results}
steps=${2:-pytest,loads,exact,engine}
source bench/h200_env.sh
want pytest && step 150 pytest_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider \
  --continue-on-collection-errors tests  # the device lacks the service's packages (fastapi, sqlalchemy, ...)
want loads && step 200 bench_loads.log python3 -m tierplan.api.cli bench substrate --device cuda --only "${SUBSTRATE_ONLY:-loads,urgent}" \
  --load-configs "${LOAD_CONFIGS:-map-in}" --out-dir "$out"
want exact && step 100 exact_qwen3_2L.log python3 -m tierplan.api.cli check exact --preset qwen3-30b-a3b --layers 2 \
  --resident-frac 0.25 --device cuda
want engine && step 300 bench_engine.log python3 -m tierplan.api.cli bench engine --device cuda --out-dir "$out" \
  ${ENGINE_ONLY:+--only "$ENGINE_ONLY"} ${ENGINE_PROFILE:+--profile}
exit 0
