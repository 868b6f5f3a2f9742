# bash .ab/ab.sh OUT : run11 tree and this tree, interleaved twice, on one machine
out=$1; steps=none; source bench/h200_env.sh
root=$PWD
for i in 1 2; do
  (cd .ab/run11 && PYTHONPATH=/tmp/site:$root/.ab/run11 timeout 200 python3 $root/bench/results/h200/offload_run17/probe.py.txt (copied to .ab/probe.py) old$i $out/old$i.json) 2>&1 | grep -v "^\s*$" | tail -12
  timeout 200 python3 bench/results/h200/offload_run17/probe.py.txt (copied to .ab/probe.py) new$i $out/new$i.json 2>&1 | tail -14
done
