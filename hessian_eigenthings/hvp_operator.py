"""0.x module path ``hessian_eigenthings.hvp_operator`` (deprecated; removed in 2.0.0).

Re-exports the 0.x ``HVPOperator`` from :mod:`hessian_eigenthings.compat`; it
warns when constructed. 1.0: ``hessian_eigenthings.HessianOperator``. The
other names are those 0.x's module imported.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils.data as data

import hessian_eigenthings.compat.utils as utils  # the helpers of 0.x's utils module
from hessian_eigenthings.compat.hvp_operator import HVPOperator
from hessian_eigenthings.compat.operator import Operator

__all__ = ["Callable", "HVPOperator", "Operator", "data", "nn", "torch", "utils"]
