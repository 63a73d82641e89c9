#!/usr/bin/env bash
# Start an MLflow tracking server for raylane runs: sqlite backend, artifacts served through the
# server (workers on any node need only its URL), bound to 127.0.0.1 unless MLFLOW_HOST says
# otherwise (reach a remote one through an SSH tunnel). Runs in the foreground; Ctrl-C stops it.
#
#   scripts/mlflow-server.sh            # then: export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
#   MLFLOW_PORT=5001 MLFLOW_DATA=/data/mlflow scripts/mlflow-server.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mlflow="${MLFLOW_BIN:-$here/.venv/bin/mlflow}"
[[ -x "$mlflow" ]] || mlflow="$(command -v mlflow)"
# MLflow 3's job runner (8 huey consumers, for its GenAI jobs) is off unless asked for: raylane
# uses none of its jobs, and on 2 cores it cost 20 s of CPU at each start (31 s against 11 s to
# health plus 8 s) and ~2% of a core while idle. MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true turns it on.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
data="${MLFLOW_DATA:-$here/mlflow-server}"
mkdir -p "$data/artifacts"
echo "MLflow UI and tracking URI: http://$host:$port   (export MLFLOW_TRACKING_URI=http://$host:$port)"
exec "$mlflow" server --host "$host" --port "$port" --workers 1 \
    --backend-store-uri "sqlite:///$data/mlflow.db" \
    --serve-artifacts --artifacts-destination "$data/artifacts"
