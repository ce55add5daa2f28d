"""The 0.x API of hessian-eigenthings, kept so 0.x code runs unchanged (and warns).

Every entry point translates its 0.x arguments, makes one call into the 1.0
core (operators and algorithms) and translates the result back to the 0.x
types. All deprecations are listed in ``_deprecations.DEPRECATIONS``; the
before/after of each is in ``migration_guide.md``. Removed in 2.0.0.

Importing ``lanczos`` or ``deflated_power_iteration`` from here always gives
the 0.x function; the top-level names route by the call (see
``compat.routing``).
"""

from hessian_eigenthings.compat._deprecations import DEPRECATIONS, CPUFallbackWarning
from hessian_eigenthings.compat.eigenthings import compute_hessian_eigenthings
from hessian_eigenthings.compat.hvp_operator import HVPOperator
from hessian_eigenthings.compat.lanczos import lanczos
from hessian_eigenthings.compat.operator import LambdaOperator, Operator
from hessian_eigenthings.compat.power_iter import deflated_power_iteration, power_iteration
from hessian_eigenthings.compat.utils import format_time, log, maybe_fp16, progress_bar

__all__ = [
    "DEPRECATIONS",
    "CPUFallbackWarning",
    "HVPOperator",
    "LambdaOperator",
    "Operator",
    "compute_hessian_eigenthings",
    "deflated_power_iteration",
    "format_time",
    "lanczos",
    "log",
    "maybe_fp16",
    "power_iteration",
    "progress_bar",
]
