"""``python -m hessian_eigenthings`` and the ``hessian-eigenthings`` console script."""

from __future__ import annotations

import sys

from hessian_eigenthings.cli import main

if __name__ == "__main__":
    sys.exit(main())
