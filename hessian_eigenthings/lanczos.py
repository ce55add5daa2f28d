"""0.x module path ``hessian_eigenthings.lanczos`` (deprecated; removed in 2.0.0).

``from hessian_eigenthings.lanczos import lanczos`` gives the 0.x function
(it warns when called). The package attribute ``hessian_eigenthings.lanczos``
is the routed top-level function, not this module: the package loads this
module before binding that name, so importing it later does not shadow the
function. Should the module ever be bound there instead, calling it routes
the same way (its type is ``compat.routing.CallableModule``). The other
names are those 0.x's module imported.
"""

import importlib
import sys
from typing import Any, Tuple  # noqa: UP035 -- a name 0.x's module exposed
from warnings import warn

import numpy as np
import torch

import hessian_eigenthings.compat.utils as utils  # the helpers of 0.x's utils module
from hessian_eigenthings.compat.lanczos import lanczos
from hessian_eigenthings.compat.operator import Operator
from hessian_eigenthings.compat.routing import CallableModule

sys.modules[__name__].__class__ = CallableModule


def __getattr__(name: str) -> Any:
    # scipy's sparse linalg costs ~0.3 s to import: load it only for code that asks
    if name == "linalg":
        return importlib.import_module("scipy.sparse.linalg")
    if name == "ScipyLinearOperator":
        return importlib.import_module("scipy.sparse.linalg").LinearOperator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Operator",
    "Tuple",
    "lanczos",
    "np",
    "torch",
    "utils",
    "warn",
]
