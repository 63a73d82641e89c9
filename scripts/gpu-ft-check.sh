#!/usr/bin/env bash
# Issue 62's kill on GPUs: 2 replica groups with `fault_tolerance.process_group: nccl`, one GPU per
# rank (NCCL takes no two ranks on one GPU, so one GPU cannot hold both groups: on an H200 with
# NCCL 2.28.9, scripts/gpu_nccl_two_ranks.py got "Duplicate GPU detected"). Group 1 is
# SIGKILLed at step 8, started again, and heals from group 0 over NCCL while group 0 steps on;
# both end at step 100 with equal weights and optimizer state. No Ray and no MLflow: the loop
# under the launcher's contract, as tests/e2e/test_ft_loop.py runs it.
#
#   scripts/gpu-ft-check.sh        # 2 GPUs: groups of 1 (DDP); 4 GPUs: groups of 2 (FSDP) too
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
  "$PY" scripts/gpu_nccl_two_ranks.py || true  # whether this machine's one GPU takes two ranks
fi
exec "$PY" -m pytest tests/e2e/test_ft_loop.py -k on_gpus_with_nccl -m gpu -q -s -p no:cacheprovider "$@"
