#!/usr/bin/env bash
# Creates .venv (once) and installs the package with its test and example dependencies.
# Idempotent: a stamp file skips the installs when pyproject.toml has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=".venv/.installed-$(sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build of torch 2.13.0 installs from a local file on these machines.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[dev]"
    # curvlinops for the cross-library tests, without backpack (it pulls torchvision, which
    # pins another torch with several GB of CUDA libraries); curvlinops' core does not import it.
    .venv/bin/python -m pip install -q --no-deps "curvlinops-for-pytorch==3.0.1"
    .venv/bin/python -m pip install -q einconv einops linear_operator opt-einsum
    touch "$stamp"
fi
