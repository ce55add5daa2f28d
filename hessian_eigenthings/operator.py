"""0.x module path ``hessian_eigenthings.operator`` (deprecated; removed in 2.0.0).

Re-exports the 0.x ``Operator`` and ``LambdaOperator`` from
:mod:`hessian_eigenthings.compat`; they warn when constructed. 1.0:
``hessian_eigenthings.CurvatureOperator`` and ``hessian_eigenthings.LambdaOperator``.
"""

from hessian_eigenthings.compat.operator import LambdaOperator, Operator

__all__ = ["LambdaOperator", "Operator"]
