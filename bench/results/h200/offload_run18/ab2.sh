# bash .ab/ab2.sh OUT : this tree, map beside (default) vs on_read, interleaved twice
out=$1; steps=none; source bench/h200_env.sh
for i in 1 2; do
  timeout 200 python3 bench/results/h200/offload_run17/probe.py.txt (copied to .ab/probe.py) beside$i $out/beside$i.json 2>&1 | grep -v "F=1.0" | tail -10
  MAPIN=on_read timeout 200 python3 bench/results/h200/offload_run17/probe.py.txt (copied to .ab/probe.py) onread$i $out/onread$i.json 2>&1 | grep -v "F=1.0" | tail -10
done
