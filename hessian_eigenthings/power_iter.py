"""0.x module path ``hessian_eigenthings.power_iter`` (deprecated; removed in 2.0.0).

Re-exports the 0.x functions from :mod:`hessian_eigenthings.compat`; they
warn when called. 1.0: ``hessian_eigenthings.algorithms.power_iteration_one``
and ``deflated_power_iteration(op, k=...)``. The other names are those 0.x's
module imported (scripts reached them through it, e.g.
``from hessian_eigenthings.power_iter import LambdaOperator``).
"""

from typing import Tuple  # noqa: UP035 -- a name 0.x's module exposed

import numpy as np
import torch

import hessian_eigenthings.compat.utils as utils  # the helpers of 0.x's utils module
from hessian_eigenthings.compat.operator import LambdaOperator, Operator
from hessian_eigenthings.compat.power_iter import deflated_power_iteration, power_iteration

__all__ = [
    "LambdaOperator",
    "Operator",
    "Tuple",
    "deflated_power_iteration",
    "np",
    "power_iteration",
    "torch",
    "utils",
]
