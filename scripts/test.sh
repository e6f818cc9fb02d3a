#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite on the real SGLang server
# and a tiny random Llama the suite builds itself. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
exec .venv/bin/python -m pytest "$@"
