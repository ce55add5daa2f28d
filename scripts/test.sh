#!/usr/bin/env bash
# README's test command: sets up .venv if needed, then runs the test suite.
# Triton kernels run in interpreter mode on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
.venv/bin/python -m pytest -q "$@"
