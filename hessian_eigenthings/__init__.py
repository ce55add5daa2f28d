"""hessian-eigenthings: curvature of a model's loss as matrix-free operators."""

from hessian_eigenthings._version import __version__
from hessian_eigenthings.linalg_distributed import DistributedBackend, is_main_process
from hessian_eigenthings.operators import (
    CurvatureOperator,
    DDPHessianOperator,
    FSDPHessianOperator,
    HessianOperator,
    LambdaOperator,
)

__all__ = [
    "CurvatureOperator",
    "DDPHessianOperator",
    "DistributedBackend",
    "FSDPHessianOperator",
    "HessianOperator",
    "LambdaOperator",
    "__version__",
    "is_main_process",
]
