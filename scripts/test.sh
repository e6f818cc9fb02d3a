#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite on the real SGLang server
# and a tiny random Llama the suite builds itself. Extra arguments go to pytest.
# `--quick`: only the tests that start no server (SGLang, Prefect,
# PostgreSQL), in about 5 minutes; tests/tiers.py says how a test is sorted.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
quick=0
for arg in "$@"; do [ "$arg" = "--quick" ] && quick=1; done
# The Prefect UI test drives Debian's Chromium through Playwright (never
# `playwright install`: the machines are offline but for PyPI and apt).
if [ "$quick" = 0 ] && [ ! -x /usr/bin/chromium ]; then
  echo "test: installing Debian's chromium for the Prefect UI test"
  apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
# The PostgreSQL ledger tests start a private server from Debian's binaries
# (tests/pg_server.py: own data dir, loopback, stopped at the end).
if [ "$quick" = 0 ] && ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  echo "test: installing Debian's postgresql for the ledger tests"
  apt-get install -y -q postgresql >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; }
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
# Plain functions log through `eagle3.*` outside flow runs too: not an error.
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore
exec .venv/bin/python -m pytest "$@"
