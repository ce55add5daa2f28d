"""0.x helpers of ``hessian_eigenthings.utils``, kept for scripts that import them.

Each warns when called and names its standard replacement (``logging``,
``tensor.to``, ``tqdm``, ``datetime.timedelta``).
"""

from __future__ import annotations

import logging
import shutil
import sys
import time

import torch

from hessian_eigenthings.compat._deprecations import warn_deprecated

_BAR_WIDTH = 30
# module constants 0.x's utils exposed (its progress bar's width, the terminal width,
# the bar's clock), kept for scripts that read them
TOTAL_BAR_LENGTH = 65.0
term_width = shutil.get_terminal_size().columns
last_time = begin_time = time.time()


def log(msg: object) -> None:
    """``logging.info`` of ``msg`` with a ``[hessian_eigenthings]`` prefix, as 0.x."""
    warn_deprecated("log")
    logging.info("[hessian_eigenthings] " + str(msg))


def maybe_fp16(vec: torch.Tensor, fp16: bool) -> torch.Tensor:
    """``vec`` in float16 when ``fp16`` is true, else in float32."""
    warn_deprecated("maybe_fp16")
    return vec.to(torch.float16 if fp16 else torch.float32)


def progress_bar(current: int, total: int, msg: str | None = None) -> None:
    """Redraw a one-line text bar on stdout for step ``current`` (0-based) of ``total``.

    Ends the line after the last step.
    """
    warn_deprecated("progress_bar")
    total = max(int(total), 1)
    done = min(int(current) + 1, total)
    filled = _BAR_WIDTH * done // total
    bar = "=" * filled + ">" * (filled < _BAR_WIDTH) + "." * (_BAR_WIDTH - filled - 1)
    line = f"\r[{bar[:_BAR_WIDTH]}] {done}/{total}" + (f" | {msg}" if msg else "")
    sys.stdout.write(line + ("\n" if done >= total else ""))
    sys.stdout.flush()


_UNITS = (("D", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 1e-3))


def format_time(seconds: float) -> str:
    """Compact duration with its two largest units, e.g. ``format_time(3725) == '1h2m'``."""
    warn_deprecated("format_time")
    remaining = max(float(seconds), 0.0)
    parts: list[str] = []
    for unit, size in _UNITS:
        count = int(remaining // size)
        if count:
            parts.append(f"{count}{unit}")
            remaining -= count * size
        if len(parts) == 2:
            break
    return "".join(parts) or "0ms"
