#!/usr/bin/env bash
# README's main-job command: sets up .venv if needed, then runs the built-in default
# (a small model trained for a few seconds; top eigenvalues, trace, spectral density).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m hessian_eigenthings "$@"
