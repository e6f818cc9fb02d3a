#!/usr/bin/env bash
# Set up (idempotent), then run the pipeline on the embedded default:
# SmolLM2-135M-Instruct and the bundled demo conversations.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m flows.demo "$@"
