# Sourced by the bench/run_h200_*.sh scripts on the lent H200 (set `out`, and `steps` where `want` is used,
# before sourcing). The device image has no pydantic (the protocol needs it): carry wheels made here, e.g.
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_17_x86_64 -d .whl pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions   (pydantic pins its pydantic-core: check Requires-Dist)
# and name .whl in `carry`: they are installed into /tmp/site when present.
mkdir -p "$out"
# No install there: the checkout imports as `tierplan.*` through a link named tierplan (a namespace package,
# as the installed wheel is); $PWD stays on the path for `tests.*`.
mkdir -p /tmp/tp_ns && ln -sfn "$PWD" /tmp/tp_ns/tierplan
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:/tmp/tp_ns:$PWD
else
  export PYTHONPATH=/tmp/tp_ns:$PWD
fi
export PYTHONUNBUFFERED=1 TIERPLAN_SCRATCH=${TIERPLAN_SCRATCH:-/tmp}
# step SECONDS LOG CMD...: run CMD under a timeout into $out/LOG, then print its exit code, time and last line
step() { local t=$1 log=$2; shift 2; local s=$SECONDS
  timeout "$t" "$@" > "$out/$log" 2>&1; local rc=$?
  echo "== $log rc=$rc $((SECONDS - s))s: $(tail -n 1 "$out/$log")"; }
# want NAME: NAME is among the comma-separated $steps
want() { [[ ",$steps," == *",$1,"* ]]; }
