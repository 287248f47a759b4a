#!/usr/bin/env bash
# An MLflow tracking server that several training / sweep workers log to (`make mlflow-server` runs this).
#   scripts/mlflow_server.sh                     # http://127.0.0.1:5000; SQLite store + artifacts in runs/mlflow_server/
#   MLFLOW_HOST=0.0.0.0 MLFLOW_SERVER_ALLOWED_HOSTS='login1:*,localhost:*' scripts/mlflow_server.sh  # other nodes
#   MLFLOW_BACKEND_STORE_URI=postgresql://user:password@dbhost:5432/mlflow scripts/mlflow_server.sh  # many workers
# Workers: `flowlm-train logger=mlflow_server logger.tracking_uri=http://<host>:<port> ...`.
# Settings are environment variables with mlflow's own names: MLFLOW_HOST, MLFLOW_PORT, MLFLOW_WORKERS,
# MLFLOW_BACKEND_STORE_URI, MLFLOW_ARTIFACTS_DESTINATION (a folder, or s3://...), MLFLOW_SERVER_ALLOWED_HOSTS (the
# Host headers accepted, port included: by default localhost and private IPs only, so workers that use the server's
# host name need 'name:*');
# FLOWLM_RUNS moves the default folder (runs/, relative to the current directory as for flowlm-train); MLFLOW
# names the mlflow executable. Further arguments go to `mlflow server` unchanged.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mlflow_bin=${MLFLOW:-$here/.venv/bin/mlflow}
[[ -x $mlflow_bin ]] || mlflow_bin=mlflow

mkdir -p "${FLOWLM_RUNS:-runs}/mlflow_server"
root=$(cd "${FLOWLM_RUNS:-runs}/mlflow_server" && pwd)
host=${MLFLOW_HOST:-127.0.0.1}
port=${MLFLOW_PORT:-5000}
backend=${MLFLOW_BACKEND_STORE_URI:-sqlite:///$root/mlflow.db}
artifacts=${MLFLOW_ARTIFACTS_DESTINATION:-$root/artifacts}
# SQLite takes one writer at a time: one server process (it answers requests on threads); a database server: 4.
if [[ $backend == sqlite:* ]]; then workers=${MLFLOW_WORKERS:-1}; else workers=${MLFLOW_WORKERS:-4}; fi
[[ $artifacts == *://* ]] || mkdir -p "$artifacts"
# mlflow's background job runner (GenAI features) starts ~7 more processes that runs and artifacts do not use.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}

echo "MLflow tracking server: http://$host:$port  store: $backend  artifacts: $artifacts  workers: $workers" >&2
# --serve-artifacts: clients upload artifacts through the server (mlflow-artifacts:/) into --artifacts-destination,
# so workers on other nodes need neither a shared disk nor storage credentials.
exec "$mlflow_bin" server --host "$host" --port "$port" --workers "$workers" \
  --backend-store-uri "$backend" --serve-artifacts --artifacts-destination "$artifacts" "$@"
