"""0.x ``power_iteration`` and ``deflated_power_iteration`` on the 1.0 solvers.

Argument map (0.x -> 1.0): ``steps`` / ``power_iter_steps`` -> ``max_iter``,
``num_eigenthings`` -> ``k``, ``init_vec`` -> ``init``, ``momentum`` as is,
and ``error_threshold`` / ``power_iter_err_threshold`` -> ``tol`` as in
NOTE [0.x power iteration threshold].
0.x drew start vectors from torch's global generator; the facade draws the
1.0 ``seed`` from it, so ``torch.manual_seed`` still makes runs repeatable.
Results: ``(float, tensor)`` for ``power_iteration``; numpy arrays (also
with ``to_numpy=False``, see NOTE [0.x deflated results]) sorted by
eigenvalue, descending, for ``deflated_power_iteration``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from hessian_eigenthings.algorithms.power_iteration import (
    deflated_power_iteration as core_deflated_power_iteration,
)
from hessian_eigenthings.algorithms.power_iteration import power_iteration_one
from hessian_eigenthings.compat._deprecations import warn_deprecated
from hessian_eigenthings.compat._translate import (
    as_core_operator,
    as_numpy,
    core_convergence_warning_off,
    count,
    init_vector,
    real,
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


# NOTE [0.x deflated results]
# 0.x collected the eigenvalues as Python floats and the eigenvectors as CPU tensors (numpy
# arrays with to_numpy=True), then called np.array on both lists: the result was two numpy
# arrays whatever to_numpy said (float64 values; float32 vectors, float16 with fp16=True),
# so 0.x code calls .copy(), np.save or indexes them as arrays. The facade returns those
# types; to_numpy changes nothing, as it changed nothing in 0.x. (A float64 operator keeps
# float64 vectors, where 0.x cut them to float32.)


def _tol(name: str, threshold: object, hint: str) -> float:
    # a threshold <= 0 (or NaN) never stopped 0.x early: tol=0 runs the whole budget
    value = real(name, threshold, hint=hint)
    return math.sqrt(value) if value > 0 else 0.0


def _steps(name: str, value: object, replacement: str) -> int:
    steps = count(name, value, hint=f"1.0: {replacement}")
    if steps < 1:
        raise ValueError(
            f"{name} must be >= 1, got {steps} (0.x ran no step and crashed with "
            f"UnboundLocalError; 1.0: {replacement})"
        )
    return steps


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
    steps = _steps("steps", steps, "power_iteration_one(op, max_iter=...)")
    tol = _tol("error_threshold", error_threshold, "1.0: power_iteration_one(op, tol=...)")
    momentum = real("momentum", momentum, hint="1.0: power_iteration_one(op, momentum=...)")
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
    descending; numpy arrays whatever ``to_numpy`` says, as 0.x (NOTE [0.x deflated results]).
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
    k = count("num_eigenthings", num_eigenthings, hint="1.0: deflated_power_iteration(op, k=...)")
    if k > op.size:
        raise ValueError(
            f"num_eigenthings={k} must be at most the operator size {op.size} (0.x returned "
            "spurious pairs of the deflated zero operator; 1.0: deflated_power_iteration(op, k=...))"
        )
    steps = _steps(
        "power_iter_steps", power_iter_steps, "deflated_power_iteration(op, max_iter=...)"
    )
    tol = _tol(
        "power_iter_err_threshold",
        power_iter_err_threshold,
        "1.0: deflated_power_iteration(op, tol=...)",
    )
    momentum = real("momentum", momentum, hint="1.0: deflated_power_iteration(op, momentum=...)")
    # See NOTE [0.x deflated results]
    value_dtype, vector_dtype = np.float64, as_numpy(torch.empty(0, dtype=op.dtype)).dtype
    if k <= 0:  # 0.x's loop ran zero times
        return np.zeros(0, value_dtype), np.zeros((0, op.size), vector_dtype)
    # 0.x treated power_iter_steps as a budget and never reported convergence; the facade keeps
    # that (1.0 code reads result.converged, and the 1.0 function warns)
    with core_convergence_warning_off():
        result = core_deflated_power_iteration(
            op, k=k, max_iter=steps, tol=tol, momentum=momentum, seed=seed_from_global_rng()
        )
    values, vectors = sorted_pairs(result.eigenvalues, result.eigenvectors, descending=True)
    return as_numpy(values).astype(value_dtype), as_numpy(vectors).astype(vector_dtype, copy=False)


__all__ = ["deflated_power_iteration", "power_iteration"]
