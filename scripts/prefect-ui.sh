#!/usr/bin/env bash
# Operate the pipeline from the Prefect UI: start a local Prefect server (SQLite,
# telemetry off), create the process work pool, deploy prefect.yaml, and start a
# worker. Ctrl-C stops the worker and the server.
#
# With PREFECT_API_URL already set (a remote Prefect server), no local server is
# started: the pool, the deployments and the worker go to that server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

export PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-2}"
export EAGLE3_REPO="$PWD"  # prefect.yaml's pull step runs flows from this checkout
POOL="${EAGLE3_POOL:-eagle3}"
prefect=.venv/bin/prefect

# Job control puts each child in its own process group with SIGINT handled
# (a plain background job would ignore it), so Ctrl-C reaches this script
# alone and the shutdown has an order: the worker first (it still needs the
# API to report its runs), then the server. Each gets SIGINT, then SIGKILL
# after 20 s.
set -m
pids=()
stop_one() {
  kill -INT -- "-$1" 2>/dev/null || return 0
  for _ in $(seq 40); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL -- "-$1" 2>/dev/null || true
}
stop() {
  trap - EXIT INT TERM
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do stop_one "${pids[i]}"; done
}
trap stop EXIT INT TERM

if [ -z "${PREFECT_API_URL:-}" ]; then
  host="${PREFECT_SERVER_API_HOST:-127.0.0.1}" port="${PREFECT_SERVER_API_PORT:-4200}"
  export PREFECT_API_URL="http://$host:$port/api"
  PREFECT_SERVER_API_HOST="$host" PREFECT_SERVER_API_PORT="$port" "$prefect" server start &
  pids+=($!)
  for _ in $(seq 120); do
    curl -sf "$PREFECT_API_URL/health" >/dev/null && break
    sleep 1
  done
  curl -sf "$PREFECT_API_URL/health" >/dev/null || { echo "Prefect server did not start" >&2; exit 1; }
fi

"$prefect" work-pool inspect "$POOL" >/dev/null 2>&1 || "$prefect" work-pool create "$POOL" --type process
"$prefect" --no-prompt deploy --all
"$prefect" worker start --pool "$POOL" &
pids+=($!)
echo "Prefect UI: ${PREFECT_API_URL%/api}   (Ctrl-C stops the worker and the server)"
wait
