#!/usr/bin/env bash
# The cluster path in a few verbs, around Ray's cluster launcher and jobs CLI:
#
#   scripts/cluster.sh token                 # once: create ~/.ray/auth_token (never commit it)
#   scripts/cluster.sh up                    # ray up cluster.yaml (head only; GPU nodes on demand)
#   scripts/cluster.sh tunnel                # dashboard :8265 and MLflow :5000 on localhost (keep open)
#   scripts/cluster.sh submit pipelines/digits.yaml --set scaling.num_workers=8 --set scaling.use_gpu=true
#   scripts/cluster.sh logs JOB_ID           # follow a job's logs
#   scripts/cluster.sh down                  # ray down cluster.yaml
#
# submit runs `raylane train` as a Ray job through the tunnel: this checkout is the working
# directory (local state excluded), checkpoints go to $RAYLANE_STORAGE (s3://...), metrics to
# the head's MLflow server.
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER=${CLUSTER:-cluster.yaml}
RAY=${RAY:-$( [ -x .venv/bin/ray ] && echo .venv/bin/ray || echo ray )}
export RAY_AUTH_MODE=token RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
EXCLUDES='[".venv", ".git", "runs", "mlflow.db", "mlruns", "mlartifacts", "mlflow-server", "test-artifacts", "**/__pycache__"]'

case "${1:-}" in
  token)
    mkdir -p ~/.ray && chmod 700 ~/.ray
    [ -s ~/.ray/auth_token ] || { python3 -c 'import secrets; print(secrets.token_hex(32))' > ~/.ray/auth_token; chmod 600 ~/.ray/auth_token; }
    echo "token in ~/.ray/auth_token" ;;
  up)
    [ -s ~/.ray/auth_token ] || { echo "cluster.sh: no ~/.ray/auth_token; run: scripts/cluster.sh token" >&2; exit 2; }
    "$RAY" up -y "$CLUSTER" ;;
  down)
    "$RAY" down -y "$CLUSTER" ;;
  tunnel)
    # Both servers listen on the head only; reach them over SSH.
    "$RAY" attach "$CLUSTER" --port-forward 8265 --port-forward 5000 ;;
  submit)
    shift
    config=${1:?usage: cluster.sh submit CONFIG [--set KEY=VALUE ...]}; shift
    storage=${RAYLANE_STORAGE:?set RAYLANE_STORAGE=s3://your-bucket/raylane}
    # The head's address on the cluster's own network, where the ranks reach its MLflow server.
    # Not `ray get-head-ip`: that is the public address, which the security group closes to the
    # nodes and MLflow 3's host check refuses (it admits loopback and private addresses).
    head_ip=$("$RAY" exec "$CLUSTER" 'hostname -I' 2>/dev/null | tail -1 | awk '{print $1}')
    runtime_env=$(printf '{"excludes": %s, "env_vars": {"MLFLOW_TRACKING_URI": "http://%s:5000"}}' "$EXCLUDES" "$head_ip")
    "$RAY" job submit --no-wait --working-dir . --runtime-env-json "$runtime_env" -- \
      raylane train "$config" --set run.storage_path="$storage" "$@" ;;
  logs)
    "$RAY" job logs --follow "${2:?usage: cluster.sh logs JOB_ID}" ;;
  *)
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    exit 2 ;;
esac
