#!/usr/bin/env bash
# GPT-2 small's shape (pipelines/gpt2-124m.yaml) on the GPUs of this machine under plain
# torchrun (no Ray, no MLflow): NCCL when there is more than one GPU, bf16, torch.compile, a
# fixed number of steps, no checkpoint or evaluation until the end (the Python help text is a
# small corpus: an epoch is ~28 steps, and a 2 GB save at each epoch end would dominate). Prints
# tokens/s, MFU and peak memory (the first steps, compilation included, are left out).
#
#   scripts/gpu-check.sh                    # all visible GPUs, 60 steps
#   STEPS=100 NPROC=1 scripts/gpu-check.sh --set train.batch_size=32
#
# Extra arguments are passed to `raylane train` (for example --set train.compile=false).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
STEPS=${STEPS:-60}
NPROC=${NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
if [ "$NPROC" -lt 1 ]; then
  echo "gpu-check: no CUDA device visible to torch" >&2
  exit 1
fi
OUT=${OUT:-$(mktemp -d)}
SUMMARY="$OUT/gpu-check.json"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m raylane train pipelines/gpt2-124m.yaml \
  --set scaling.use_gpu=true --set scaling.num_workers="$NPROC" --set train.max_steps="$STEPS" \
  --set mlflow.enabled=false --set checkpoint.every_n_steps=0 --set checkpoint.every_n_epochs=0 \
  --set train.eval_every_n_epochs=0 --set run.storage_path="$OUT/runs" \
  --summary-json "$SUMMARY" "$@"
"$PY" - "$SUMMARY" <<'PY'
import json, sys

import torch

s = json.load(open(sys.argv[1]))
mfu = f"{100 * s['mfu']:.1f}%" if s.get("mfu") else "n/a (unknown GPU: set scaling.peak_tflops)"
print(f"device:        {torch.cuda.get_device_name(0)} x {s['world_size']} ({s['strategy']}, backend {s['backend']})")
print(f"steps:         {s['steps']} ({s['status']})")
print(f"tokens/s:      {s['tokens_per_s']:,.0f}")
print(f"MFU:           {mfu}")
print(f"peak memory:   {s['memory']['peak_bytes'] / 2**30:.2f} GiB per GPU")
print(f"state:         {s['memory']['state_bytes_per_rank'] / 2**30:.2f} GiB per rank")
print(f"summary:       {sys.argv[1]}")
PY
