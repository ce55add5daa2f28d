"""hessian-eigenthings: curvature of a model's loss as matrix-free operators."""

from hessian_eigenthings._version import __version__
from hessian_eigenthings.operators import (
    CurvatureOperator,
    HessianOperator,
    LambdaOperator,
)

__all__ = ["CurvatureOperator", "HessianOperator", "LambdaOperator", "__version__"]
