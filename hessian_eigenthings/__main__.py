"""``python -m hessian_eigenthings`` and the ``hessian-eigenthings`` console script."""

from __future__ import annotations

import os
import sys

from hessian_eigenthings.cli import main as _main


def main() -> int:
    """The command; a reader that goes away (``| head``) ends it quietly with status 1, as
    Python's own EPIPE rule, instead of a traceback."""
    try:
        code = _main()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit flush writes nowhere
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
