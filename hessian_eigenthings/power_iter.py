"""0.x module path ``hessian_eigenthings.power_iter`` (deprecated; removed in 2.0.0).

Re-exports the 0.x functions from :mod:`hessian_eigenthings.compat`; they
warn when called. 1.0: ``hessian_eigenthings.algorithms.power_iteration_one``
and ``deflated_power_iteration(op, k=...)``.
"""

from hessian_eigenthings.compat.power_iter import deflated_power_iteration, power_iteration

__all__ = ["deflated_power_iteration", "power_iteration"]
