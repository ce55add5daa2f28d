"""0.x module path ``hessian_eigenthings.hvp_operator`` (deprecated; removed in 2.0.0).

Re-exports the 0.x ``HVPOperator`` from :mod:`hessian_eigenthings.compat`; it
warns when constructed. 1.0: ``hessian_eigenthings.HessianOperator``.
"""

from hessian_eigenthings.compat.hvp_operator import HVPOperator

__all__ = ["HVPOperator"]
