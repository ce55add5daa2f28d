#!/usr/bin/env bash
# The test command of README.md. Triton kernels run in interpreter mode on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q "$@"
