#!/usr/bin/env bash
# README's main-job command: sets up .venv if needed, then runs the built-in default
# (a small model trained for a few seconds; top eigenvalues, trace, spectral density).
# Runs where the user stands, like the installed `hessian-eigenthings`: relative paths
# (--model file.py:fn, -o out) are the user's, not the checkout's.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
exec "$repo/.venv/bin/python" -m hessian_eigenthings "$@"
