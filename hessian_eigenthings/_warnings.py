"""Where a warning raised inside the package should point: the user's line."""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(str(__import__("torch").__file__))) + os.sep


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by the caller of this function, such that the
    warning points at the first frame outside this package and torch (products run through
    a varying number of frames: kept or fresh states, blocks, CUDA streams)."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


class EmptyBatchWarning(UserWarning):
    """Batches of zero samples were skipped: they carry no weight in an average over samples."""


class FactorPassCostWarning(UserWarning):
    """A Kronecker factor pass (KFAC, EKFAC, KFOC) will take many backward passes per batch: the
    exact type-2 factor backpropagates every column of the loss Hessian (one per output class)."""
