"""0.x module path ``hessian_eigenthings.utils`` (deprecated; removed in 2.0.0).

Re-exports the 0.x helpers from :mod:`hessian_eigenthings.compat`; they warn
when called. The other names are those 0.x's module held.
"""

import logging
import shutil
import sys
import time

from hessian_eigenthings.compat.utils import (
    TOTAL_BAR_LENGTH,
    begin_time,
    format_time,
    last_time,
    log,
    maybe_fp16,
    progress_bar,
    term_width,
)

__all__ = [
    "TOTAL_BAR_LENGTH",
    "begin_time",
    "format_time",
    "last_time",
    "log",
    "logging",
    "maybe_fp16",
    "progress_bar",
    "shutil",
    "sys",
    "term_width",
    "time",
]
