#!/bin/bash
# A Ray Data streaming run (tabular, 4 Parquet files, 2 workers, 2 epochs) and `raylane submit`
# (digits, 1 epoch, --follow) on a head without warm workers and on a warm one, interleaved.
P=/work/main/.venv/bin/python
run() { # name warm-flag rep
  local name=$1 warm=$2 rep=$3
  local home=/tmp/b52s/$name-$rep; rm -rf $home; mkdir -p $home/work
  export RAYLANE_HOME=$home MLFLOW_TRACKING_URI=sqlite:///$home/mlflow.db OMP_NUM_THREADS=1
  cd $home/work
  $P -m raylane up $warm > $home/up.log 2>&1
  sleep 60
  local t0=$(date +%s.%N)
  $P -m raylane train tabular --set data.train=/tmp/b52s/data --set train.max_epochs=2 --set mlflow.enabled=false > $home/stream.log 2>&1; local rc=$?
  local t1=$(date +%s.%N)
  echo "$name rep=$rep stream rc=$rc s=$(echo "$t1 - $t0" | bc) load=$(cut -d' ' -f1-3 /proc/loadavg) $(grep -o '[0-9]* of [0-9]* actors started on warm workers' $home/stream.log)" | tee -a /tmp/b52s/results.txt
  sleep 20
  local url=$($P -c "import json;print(json.load(open('$home/cluster.json'))['dashboard_url'])")
  t0=$(date +%s.%N)
  $P -m raylane submit digits --address $url --follow --set train.max_epochs=1 --set mlflow.enabled=false > $home/submit.log 2>&1; rc=$?
  t1=$(date +%s.%N)
  echo "$name rep=$rep submit rc=$rc s=$(echo "$t1 - $t0" | bc) load=$(cut -d' ' -f1-3 /proc/loadavg)" | tee -a /tmp/b52s/results.txt
  $P -m raylane down > $home/down.log 2>&1
  sleep 5
}
: > /tmp/b52s/results.txt
for rep in 1 2; do run plain "--warm 0" $rep; run warm "--warm" $rep; done
echo done >> /tmp/b52s/results.txt
