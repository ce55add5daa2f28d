"""0.x ``power_iteration`` and ``deflated_power_iteration`` on the 1.0 solvers.

Argument map (0.x -> 1.0): ``steps`` / ``power_iter_steps`` -> ``max_iter``,
``error_threshold`` / ``power_iter_err_threshold`` -> ``tol``,
``num_eigenthings`` -> ``k``, ``init_vec`` -> ``init``, ``momentum`` as is.
0.x drew start vectors from torch's global generator; the facade draws the
1.0 ``seed`` from it, so ``torch.manual_seed`` still makes runs repeatable.
Results: ``(float, tensor)`` for ``power_iteration``; numpy arrays (or
tensors with ``to_numpy=False``) sorted by eigenvalue, descending, for
``deflated_power_iteration``.
"""

from __future__ import annotations

from typing import Any

import torch

from hessian_eigenthings.algorithms.power_iteration import (
    deflated_power_iteration as core_deflated_power_iteration,
)
from hessian_eigenthings.algorithms.power_iteration import power_iteration_one
from hessian_eigenthings.compat._deprecations import warn_deprecated
from hessian_eigenthings.compat._translate import (
    as_core_operator,
    as_numpy,
    check_bool,
    check_float,
    check_int,
    init_vector,
    seed_from_global_rng,
)


def power_iteration(
    operator: Any,
    steps: int = 20,
    error_threshold: float = 1e-4,
    momentum: float = 0.0,
    use_gpu: bool = True,
    fp16: bool = False,
    init_vec: Any = None,
) -> tuple[float, torch.Tensor]:
    """0.x power iteration. Deprecated: use ``power_iteration_one(op, max_iter=..., tol=...)``.

    Returns ``(eigenvalue, eigenvector)``: the eigenvalue of largest
    magnitude as a float and its unit eigenvector as a tensor ``(n,)``.
    """
    warn_deprecated("power_iteration")
    op = as_core_operator(operator, use_gpu=use_gpu, fp16=fp16, what="power_iteration")
    steps = check_int("steps", steps, minimum=1, hint="1.0: power_iteration_one(op, max_iter=...)")
    tol = check_float("error_threshold", error_threshold, minimum=0.0, hint="1.0: power_iteration_one(op, tol=...)")
    momentum = check_float("momentum", momentum, minimum=0.0, hint="1.0: power_iteration_one(op, momentum=...)")
    init = init_vector(init_vec, op, "init_vec")
    result = power_iteration_one(
        op,
        max_iter=steps,
        tol=tol,
        momentum=momentum,
        init=init,
        seed=None if init is not None else seed_from_global_rng(),
    )
    return float(result.eigenvalue), result.eigenvector


def deflated_power_iteration(
    operator: Any,
    num_eigenthings: int = 10,
    power_iter_steps: int = 20,
    power_iter_err_threshold: float = 1e-4,
    momentum: float = 0.0,
    use_gpu: bool = True,
    fp16: bool = False,
    to_numpy: bool = True,
) -> tuple[Any, Any]:
    """0.x deflated power iteration. Deprecated: use ``deflated_power_iteration(op, k=...)`` (1.0).

    Returns ``(eigenvalues (k,), eigenvectors (k, n))`` sorted by eigenvalue,
    descending; numpy arrays, or tensors with ``to_numpy=False``.
    """
    warn_deprecated("deflated_power_iteration")
    return run_deflated_power_iteration(
        operator, num_eigenthings, power_iter_steps, power_iter_err_threshold, momentum, use_gpu, fp16, to_numpy
    )


def run_deflated_power_iteration(
    operator: Any,
    num_eigenthings: int = 10,
    power_iter_steps: int = 20,
    power_iter_err_threshold: float = 1e-4,
    momentum: float = 0.0,
    use_gpu: bool = True,
    fp16: bool = False,
    to_numpy: bool = True,
) -> tuple[Any, Any]:
    """The body of 0.x ``deflated_power_iteration`` without the warning."""
    op = as_core_operator(operator, use_gpu=use_gpu, fp16=fp16, what="deflated_power_iteration")
    k = check_int("num_eigenthings", num_eigenthings, minimum=1, hint="1.0: deflated_power_iteration(op, k=...)")
    if k > op.size:
        raise ValueError(
            f"num_eigenthings={k} must be at most the operator size {op.size} "
            "(1.0: deflated_power_iteration(op, k=...))"
        )
    steps = check_int(
        "power_iter_steps", power_iter_steps, minimum=1, hint="1.0: deflated_power_iteration(op, max_iter=...)"
    )
    tol = check_float(
        "power_iter_err_threshold", power_iter_err_threshold, minimum=0.0,
        hint="1.0: deflated_power_iteration(op, tol=...)",
    )
    momentum = check_float("momentum", momentum, minimum=0.0, hint="1.0: deflated_power_iteration(op, momentum=...)")
    numpy_out = check_bool("to_numpy", to_numpy)
    result = core_deflated_power_iteration(
        op, k=k, max_iter=steps, tol=tol, momentum=momentum, seed=seed_from_global_rng()
    )
    descending = torch.argsort(result.eigenvalues.cpu(), descending=True, stable=True)
    values = result.eigenvalues.cpu()[descending]
    vectors = result.eigenvectors[descending.to(result.eigenvectors.device)]
    if numpy_out:
        return as_numpy(values), as_numpy(vectors)
    return values, vectors


__all__ = ["deflated_power_iteration", "power_iteration"]
