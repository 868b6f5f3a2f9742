#!/usr/bin/env bash
# The H200 run for issue 3 (engine_h200.md), sent through the device tool from the repo root:
#   bash bench/run_h200_engine.sh "$OUT" [steps]
# steps: comma-separated subset of pytest,loads,exact,engine (all by default); SUBSTRATE_ONLY (default
# loads,urgent), LOAD_CONFIGS (default map-in)
# and ENGINE_ONLY (default: every section) narrow the two benches.
# The device image has no pydantic (the agent's protocol needs it): carry wheels made here first, e.g.
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions   (pydantic pins its pydantic-core: check Requires-Dist)
# and name .whl in `carry`; this script installs them into /tmp/site when present.
set -uo pipefail
out=${1:-bench/results}
steps=${2:-pytest,loads,exact,engine}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TIERPLAN_SCRATCH=${TIERPLAN_SCRATCH:-/tmp}
step() { local t=$1 log=$2; shift 2; local s=$SECONDS
  timeout "$t" "$@" > "$out/$log" 2>&1; local rc=$?
  echo "== $log rc=$rc $((SECONDS - s))s: $(tail -n 1 "$out/$log")"; }
want() { [[ ",$steps," == *",$1,"* ]]; }
want pytest && step 150 pytest_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider tests
want loads && step 200 bench_loads.log python3 -m api.cli bench substrate --device cuda --only "${SUBSTRATE_ONLY:-loads,urgent}" \
  --load-configs "${LOAD_CONFIGS:-map-in}" --out-dir "$out"
want exact && step 100 exact_qwen3_2L.log python3 -m api.cli check exact --preset qwen3-30b-a3b --layers 2 \
  --resident-frac 0.25 --device cuda
want engine && step 300 bench_engine.log python3 -m api.cli bench engine --device cuda --out-dir "$out" \
  ${ENGINE_ONLY:+--only "$ENGINE_ONLY"}
exit 0
