#!/bin/bash
# B4 on three heads, interleaved: plain (no warm), warm (this fix), warm-before (HEAD's preload for every worker)
P=/work/main/.venv/bin/python
run() { # name code-dir warm-flag rep
  local name=$1 app=$2 warm=$3 rep=$4
  local home=/tmp/b52/$name-$rep; rm -rf $home; mkdir -p $home/work
  export RAYLANE_HOME=$home MLFLOW_TRACKING_URI=sqlite:///$home/mlflow.db PYTHONPATH=$app OMP_NUM_THREADS=1
  cd $home/work
  $P -m raylane up $warm > $home/up.log 2>&1
  sleep 75  # the pool's imports (warm) or the same idle time (plain)
  local t0=$(date +%s.%N)
  $P -m raylane tune digits-sweep > $home/tune.log 2>&1; local rc=$?
  local t1=$(date +%s.%N)
  echo "$name rep=$rep rc=$rc sweep_s=$(echo "$t1 - $t0" | bc) load=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a /tmp/b52/results.txt
  $P -m raylane down > $home/down.log 2>&1
  unset PYTHONPATH
  sleep 5
}
mkdir -p /tmp/b52; : > /tmp/b52/results.txt
for rep in 1 2; do
  run plain /work/main/app "--warm 0" $rep
  run warm /work/main/app "--warm" $rep
  [ $rep = 1 ] && run warm-before /tmp/wt-before/app "--warm" $rep
done
echo done >> /tmp/b52/results.txt
