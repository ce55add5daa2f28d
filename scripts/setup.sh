#!/usr/bin/env bash
# Creates .venv (once) and installs the package with its test and example dependencies.
# Idempotent: a stamp file skips the installs when pyproject.toml has not changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
say() { echo "setup: $*" >&2; }
stamp_of() { sha1sum pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12; }
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$PY" -m venv .venv
fi
stamp=".venv/.installed-$(stamp_of)"
if [ ! -f "$stamp" ]; then
    say "installing into .venv (first run only; about 2 minutes on a 2-core machine)"
    # NOTE [curvlinops without backpack]: curvlinops (for the cross-library tests) is installed
    # without backpack-for-pytorch, which pulls torchvision, which pins another torch with
    # several GB of CUDA libraries; curvlinops' core does not import it. pip reports that
    # unmet requirement as an "ERROR" after every later install, although nothing failed, so
    # the installs skip pip's conflict report and `pip check` at the end reports every
    # conflict except that one.
    pipi() { .venv/bin/python -m pip install -q --no-warn-conflicts "$@"; }
    say "[1/5] pip"
    pipi --upgrade pip
    # The CPU build of torch 2.13.0 installs from a local file on these machines.
    say "[2/5] torch 2.13.0"
    pipi "torch==2.13.0"
    say "[3/5] hessian-eigenthings (editable) with its dev dependencies"
    pipi -e ".[dev]"
    say "[4/5] curvlinops and laplace-torch, without torchvision"
    pipi einconv einops linear_operator opt-einsum
    pipi --no-deps "curvlinops-for-pytorch==3.0.1"
    # laplace-torch for tests/interop/test_laplace_backend.py, with what its import needs (BackPACK,
    # unfoldNd, ASDL from asdfghjkl 0.1a4), all --no-deps: laplace-torch and BackPACK require
    # torchvision, which would replace torch 2.13.0 (CPU) with a CUDA build; nothing here imports it
    pipi --no-deps "laplace-torch==0.3" "asdfghjkl==0.1a4" "backpack-for-pytorch==1.7.1" "unfoldNd==0.2.3" torchmetrics lightning-utilities
    say "[5/5] pip check"
    conflicts="$(.venv/bin/python -m pip check 2>&1 \
        | grep -v -e '^curvlinops-for-pytorch .* requires backpack-for-pytorch' -e '^No broken requirements' \
            -e '^laplace-torch .* requires torchvision' -e '^backpack-for-pytorch .* requires torchvision' || true)"
    if [ -n "$conflicts" ]; then
        say "warning: pip check reports conflicting requirements:"
        echo "$conflicts" >&2
    fi
    touch "$stamp"
    say "done"
fi
