#!/usr/bin/env bash
# Issue 65's GPU check of expert parallelism. NOT YET RUN ON A GPU: written in a session lent no
# GPU; its CPU path (USE_GPU=false, gloo) was run there. What it does:
#
# 1. One GPU: the dispatch at ep 1 on CUDA over NCCL (scripts/gpu_ep_check.py): examples/moe's
#    tiny Qwen2-MoE, its experts laid out by raylane on a one-rank ep mesh (the pairs sorted, the
#    counts and rows through all_to_all_single, the experts' own forward on their shard, the
#    combine), against the same model trained plainly on the same batches: losses within TOL,
#    every (token, choice) pair routed, step time and peak memory of each.
# 2. One GPU: `raylane train examples/moe/ep.yaml` at strategy.ep=1 under torchrun (the hf MoE
#    through the loop on CUDA): FINISHED, its tokens/s.
# 3. Two GPUs or more: the same model made larger (HIDDEN, EXPERTS, LAYERS) under torchrun on
#    NGPU GPUs at FSDP, FSDP×ep2, DDP and DDP×ep2 (NCCL), STEPS steps each, REPEATS times
#    interleaved: the median step time of each with its spread, peak memory, state bytes per rank,
#    and rank 0's last loss, which must agree across the layouts within TOL (fp32).
#
#   scripts/gpu-ep-check.sh                         # whatever GPUs the machine has
#   HIDDEN=1024 EXPERTS=16 STEPS=50 scripts/gpu-ep-check.sh
#   USE_GPU=false NGPU=2 scripts/gpu-ep-check.sh    # its path on CPU (gloo), small and slow
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
USE_GPU=${USE_GPU:-true}
NGPU=${NGPU:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
STEPS=${STEPS:-30}; REPEATS=${REPEATS:-3}; BATCH=${BATCH:-8}; SEQ=${SEQ:-512}; TOL=${TOL:-1e-4}
HIDDEN=${HIDDEN:-512}; EXPERTS=${EXPERTS:-8}; LAYERS=${LAYERS:-4}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
[ "$USE_GPU" = false ] || [ "$NGPU" -ge 1 ] || { echo "gpu-ep-check: no CUDA device visible to torch" >&2; exit 1; }
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$OUT/mlflow.db}

echo "== the tiny MoE and its data in $OUT/tiny; the larger one in $OUT/big"
"$PY" examples/moe/make_moe.py "$OUT/tiny"
"$PY" examples/moe/make_moe.py "$OUT/big" --hidden "$HIDDEN" --experts "$EXPERTS" --layers "$LAYERS"

echo "== 1. the dispatch at ep 1 against the plain model, one device"
"$PY" scripts/gpu_ep_check.py "$OUT/tiny/model" --steps 10 --seq-len 256 --tol "$TOL" | tee "$OUT/ep1.txt"

COMMON=(--set "scaling.use_gpu=$USE_GPU" --set "train.max_steps=$STEPS" --set "train.batch_size=$BATCH"
  --set "model.seq_len=$SEQ" --set mlflow.enabled=false --set checkpoint.every_n_steps=0
  --set checkpoint.every_n_epochs=0 --set train.eval_every_n_epochs=0 --set "run.storage_path=$OUT/runs"
  --set optim.warmup_steps=0 --set train.max_epochs=1000)
run() {  # run NAME NPROC MODEL [overrides...]: one torchrun, its summary at $OUT/NAME.json
  local name=$1 n=$2 model=$3; shift 3
  echo "== $name ($n ranks)"
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" -m raylane train examples/moe/ep.yaml \
    --set "run.name=gpu-$name" --set "scaling.num_workers=$n" --set "model.name_or_path=$model/model" \
    --set "data.train=$model/train" "${COMMON[@]}" "$@" --summary-json "$OUT/$name.json"
}

echo "== 2. raylane train at strategy.ep=1, one device"
run ep1-loop 1 "$OUT/tiny" --set strategy.ep=1 --set model.seq_len=128

if [ "$NGPU" -ge 2 ]; then
  echo "== 3. FSDP, FSDP×ep2, DDP, DDP×ep2 on $NGPU ranks"
  layouts=("fsdp 1" "fsdp 2" "ddp 1" "ddp 2")
  for r in $(seq 1 "$REPEATS"); do
    for i in "${!layouts[@]}"; do  # a different layout leads each repeat
      read -r name ep <<< "${layouts[$(( (i + r) % ${#layouts[@]} ))]}"
      run "$name-ep$ep-$r" "$NGPU" "$OUT/big" --set "strategy.name=$name" --set "strategy.ep=$ep"
    done
  done
fi

"$PY" - "$OUT" "$TOL" "$BATCH" <<'PY'
import json, pathlib, statistics, sys

out, tol, batch = pathlib.Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
one = json.loads((out / "ep1-loop.json").read_text())
print(f"ep1 loop: {one['status']}, {one['tokens_per_s'] or 0:,.0f} tokens/s, peak {one['memory']['peak_bytes'] / 2**30:.2f} GiB")
runs = {}
for f in sorted(out.glob("*-ep?-*.json")):
    s = json.loads(f.read_text())
    runs.setdefault(f.name.rsplit("-", 1)[0], []).append(s)
if not runs:
    sys.exit(0 if one["status"] == "FINISHED" else 1)
losses = {}
for layout, ss in runs.items():
    ms = [1e3 * batch * s["world_size"] / s["samples_per_s"] for s in ss]
    med = statistics.median(ms)
    losses[layout] = [s["last_window"]["loss"] for s in ss]
    print(f"{layout:10s} ({ss[0]['strategy']}): step {med:.1f} ms [{min(ms):.1f}-{max(ms):.1f}], "
          f"{statistics.median(s['tokens_per_s'] or 0 for s in ss):,.0f} tokens/s, "
          f"state {ss[0]['memory']['state_bytes_per_rank'] / 2**20:.1f} MiB/rank, "
          f"peak {max(s['memory']['peak_bytes'] for s in ss) / 2**30:.2f} GiB, last loss {losses[layout]}")
ref = losses["fsdp-ep1"][0]
gap = max(abs(v - ref) / abs(ref) for vs in losses.values() for v in vs)
print(f"last losses across layouts and repeats within {gap:.2e} (tol {tol:g})")
sys.exit(0 if gap <= tol and one["status"] == "FINISHED" else 1)
PY
