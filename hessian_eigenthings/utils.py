"""0.x module path ``hessian_eigenthings.utils`` (deprecated; removed in 2.0.0).

Re-exports the 0.x helpers from :mod:`hessian_eigenthings.compat`; they warn
when called.
"""

from hessian_eigenthings.compat.utils import format_time, log, maybe_fp16, progress_bar

__all__ = ["format_time", "log", "maybe_fp16", "progress_bar"]
