#!/usr/bin/env bash
# Issue 49's GPU check: raylane's layout path (one mesh, one parallelize()) at tp=1, pp=1 on GPT-2
# small's shape (pipelines/gpt2-124m.yaml: bf16, torch.compile) under torchrun and under Ray (an
# embedded cluster), each run's peak GPU memory set against raylane's estimate
# (scripts/memory_estimate.py). On a machine with several GPUs it then times the layouts that split
# the model, one run each on every GPU (LAYOUTS, `|`-separated, each a `,`-separated list of
# overrides), and prints their tokens/s: the multi-GPU speed figure.
#
#   scripts/gpu-layouts.sh                          # 40 steps of 16 x 1024 tokens per GPU
#   STEPS=100 LAYOUTS='strategy.name=fsdp|strategy.name=fsdp,strategy.tp=2' scripts/gpu-layouts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
STEPS=${STEPS:-40}
BATCH=${BATCH:-16}
CONFIG=${CONFIG:-pipelines/gpt2-124m.yaml}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
LAYOUTS=${LAYOUTS:-strategy.name=ddp|strategy.name=fsdp|strategy.name=fsdp,strategy.tp=2|strategy.name=fsdp,strategy.pp=2,model.tie_embeddings=false}
USE_GPU=${USE_GPU:-true}  # false: a smoke run of this script on CPU (NGPU=1 and a small model)
[ "$NGPU" -ge 1 ] || { echo "gpu-layouts: no CUDA device visible to torch" >&2; exit 1; }
COMMON=(--set "scaling.use_gpu=$USE_GPU" --set "train.max_steps=$STEPS" --set "train.batch_size=$BATCH"
  --set mlflow.enabled=false --set checkpoint.every_n_steps=0 --set checkpoint.every_n_epochs=0
  --set train.eval_every_n_epochs=0 --set "run.storage_path=$OUT/runs")

read -ra EXTRA <<< "${SETS:-}"  # more overrides for every run, e.g. SETS='--set model.n_layer=2'
run() {  # run NAME LAUNCHER NPROC [overrides...]: one run, its summary at $OUT/NAME.json
  local name=$1 launcher=$2 n=$3; shift 3
  local sets=(--set "run.name=gpu-$name" --set "scaling.num_workers=$n" "${COMMON[@]}" "${EXTRA[@]}" "$@")
  echo "== $name ($launcher, $n GPU)"
  if [ "$launcher" = torchrun ]; then
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" -m raylane train "$CONFIG" "${sets[@]}" \
      --summary-json "$OUT/$name.json"
  else
    "$PY" -m raylane train "$CONFIG" "${sets[@]}" --summary-json "$OUT/$name.json"
  fi
}

"$PY" scripts/memory_estimate.py "$CONFIG" --set "train.batch_size=$BATCH" "${EXTRA[@]}" > "$OUT/estimate.json"
run torchrun-1 torchrun 1
run ray-1 ray 1
if [ "$NGPU" -ge 2 ]; then
  IFS='|' read -ra layouts <<< "$LAYOUTS"
  for i in "${!layouts[@]}"; do
    sets=(); IFS=',' read -ra kv <<< "${layouts[$i]}"
    for x in "${kv[@]}"; do sets+=(--set "$x"); done
    run "layout-$i" torchrun "$NGPU" "${sets[@]}" || echo "layout ${layouts[$i]}: failed"
  done
fi
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
est = json.loads((out / "estimate.json").read_text())
print(f"estimate (one rank, DDP's layout): {est['ddp'] / 2**30:.2f} GiB, of which activations {est['activations'] / 2**30:.2f} GiB")
for f in sorted(out.glob("*.json")):
    if f.name == "estimate.json":
        continue
    s = json.loads(f.read_text())
    peak = s["memory"]["peak_bytes"]
    mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") else "n/a"
    print(f"{f.stem:12} {s['strategy']:16} {s['status']:9} steps {s['steps']:4}  tokens/s {s['tokens_per_s']:>10,.0f}  "
          f"MFU {mfu:>6}  peak {peak / 2**30:6.2f} GiB  peak/estimate {peak / est['ddp']:.2f}")
PY
