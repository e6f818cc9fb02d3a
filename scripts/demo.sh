#!/usr/bin/env bash
# Set up (idempotent), then run the extraction DAG on the embedded default
# (SmolLM2-135M-Instruct, the bundled demo conversations) into runs/demo/store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Prefect keeps its SQLite database with the project; with no PREFECT_API_URL
# the run starts a temporary local Prefect server by itself.
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect}" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
exec .venv/bin/python -m flows.demo "$@"
