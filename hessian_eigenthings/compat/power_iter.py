"""0.x ``power_iteration`` and ``deflated_power_iteration`` on the 1.0 solvers.

Argument map (0.x -> 1.0): ``steps`` / ``power_iter_steps`` -> ``max_iter``,
``num_eigenthings`` -> ``k``, ``init_vec`` -> ``init``, ``momentum`` as is,
and ``error_threshold`` / ``power_iter_err_threshold`` -> ``tol`` as in
NOTE [0.x power iteration threshold].
0.x drew start vectors from torch's global generator; the facade draws the
1.0 ``seed`` from it, so ``torch.manual_seed`` still makes runs repeatable.
Results: ``(float, tensor)`` for ``power_iteration``; numpy arrays (or
tensors with ``to_numpy=False``) sorted by eigenvalue, descending, for
``deflated_power_iteration``.
"""

from __future__ import annotations

import math
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
    core_convergence_warning_off,
    init_vector,
    seed_from_global_rng,
    sorted_pairs,
)

# NOTE [0.x power iteration threshold]
# 0.x stopped when the eigenvalue estimate (the Rayleigh quotient) changed by
# less than `error_threshold`, relative, between two steps; 1.0 stops when the
# relative residual ||Av - λv|| / |λ| is below `tol`. The Rayleigh quotient's
# error is quadratic in the vector's error, so its change per step is about
# the square of the residual: passing tol = sqrt(error_threshold) stops at
# about the point 0.x stopped, at the eigenvalue accuracy 0.x gave, without
# the extra steps a residual of `error_threshold` would take.


def _tol(name: str, threshold: object, hint: str) -> float:
    return math.sqrt(check_float(name, threshold, minimum=0.0, hint=hint))


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
    tol = _tol("error_threshold", error_threshold, "1.0: power_iteration_one(op, tol=...)")
    momentum = check_float(
        "momentum", momentum, minimum=0.0, hint="1.0: power_iteration_one(op, momentum=...)"
    )
    init = init_vector(init_vec, op, "init_vec")
    result = power_iteration_one(
        op,
        max_iter=steps,
        tol=tol,
        momentum=momentum,
        init=init,
        seed=None if init is not None else seed_from_global_rng(),
    )
    return float(result.eigenvalue), result.eigenvector.to(op.dtype)  # fp16=True: half, as 0.x


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
        operator,
        num_eigenthings,
        power_iter_steps,
        power_iter_err_threshold,
        momentum,
        use_gpu,
        fp16,
        to_numpy,
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
    k = check_int(
        "num_eigenthings",
        num_eigenthings,
        minimum=1,
        hint="1.0: deflated_power_iteration(op, k=...)",
    )
    if k > op.size:
        raise ValueError(
            f"num_eigenthings={k} must be at most the operator size {op.size} "
            "(1.0: deflated_power_iteration(op, k=...))"
        )
    steps = check_int(
        "power_iter_steps",
        power_iter_steps,
        minimum=1,
        hint="1.0: deflated_power_iteration(op, max_iter=...)",
    )
    tol = _tol(
        "power_iter_err_threshold",
        power_iter_err_threshold,
        "1.0: deflated_power_iteration(op, tol=...)",
    )
    momentum = check_float(
        "momentum", momentum, minimum=0.0, hint="1.0: deflated_power_iteration(op, momentum=...)"
    )
    numpy_out = check_bool("to_numpy", to_numpy)
    # 0.x treated power_iter_steps as a budget and never reported convergence; the facade keeps
    # that (1.0 code reads result.converged, and the 1.0 function warns)
    with core_convergence_warning_off():
        result = core_deflated_power_iteration(
            op, k=k, max_iter=steps, tol=tol, momentum=momentum, seed=seed_from_global_rng()
        )
    values, vectors = sorted_pairs(result.eigenvalues, result.eigenvectors, descending=True)
    if vectors.dtype != op.dtype:  # fp16=True: half, as 0.x
        vectors = vectors.to(op.dtype)
    if numpy_out:
        return as_numpy(values), as_numpy(vectors)
    return values, vectors


__all__ = ["deflated_power_iteration", "power_iteration"]
