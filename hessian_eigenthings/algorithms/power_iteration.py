"""Power iteration (with optional momentum) and deflation for top eigenpairs.

Math. ``v ← A v / ||A v||`` converges to the eigenvector of largest ``|λ|``
at rate ``|λ₂/λ₁|`` per product. With momentum ``β`` (De Sa et al., 2018)
the recurrence is ``x_{t+1} = A x_t − β x_{t−1}``, which for
``β ≈ λ₂²/4`` converges at rate ``≈ sqrt`` of the plain one; a wrong ``β``
can stall it, so the default is 0. Deflation finds the next pair on
``P A P`` with ``P = I − Σ uᵢuᵢᵀ`` over the pairs found (projection
deflation: products with the original operator between two projections).

Stopping rule: the true residual ``||A v − (vᵀAv) v|| <= max(tol · |vᵀAv|, floor)`` of
the current iterate (the floor: NOTE [convergence rule] in ``result``), available from the product just computed (one host
sync per step reads the Rayleigh quotient and the residual).

Cost: one product per step; ``deflated_power_iteration`` spends at most
``k · max_iter`` products plus ``k`` (one block) for the final residuals.
Prefer :func:`lanczos`: it needs far fewer products for the same accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.algorithms._common import (
    apply_rows,
    check_k,
    check_operator,
    global_size,
    host_arithmetic,
    host_matvec,
    make_generator,
    non_finite_error,
    operator_backend,
    progress_bar,
    random_rows,
    rounding_level,
    row_dots,
    warm_start_rows,
    work_dtype,
)
from hessian_eigenthings.algorithms.result import EigenResult, warn_convergence
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = ["PowerIterationResult", "deflated_power_iteration", "power_iteration_one"]


class _PowerIterationFields(NamedTuple):
    eigenvalue: float
    eigenvector: torch.Tensor  # (n,) unit norm, in the operator's dtype
    residual: float  # ||A v - λ v||
    iterations: int  # products spent
    converged: bool


class PowerIterationResult(_PowerIterationFields):
    """``(eigenvalue, eigenvector, residual, iterations, converged)``: it unpacks into those
    five, as DESIGN promises. ``converged`` is exactly ``residual <= max(tol · |eigenvalue|,
    residual_floor)`` (NOTE [convergence rule] in ``result``); ``tol`` and ``residual_floor``
    are attributes besides the five fields."""

    tol: float | None
    residual_floor: float

    def __new__(
        cls,
        eigenvalue: float,
        eigenvector: torch.Tensor,
        residual: float,
        iterations: int,
        converged: bool,
        tol: float | None = None,
        residual_floor: float = 0.0,
    ) -> PowerIterationResult:
        self = super().__new__(cls, eigenvalue, eigenvector, residual, iterations, converged)
        self.tol = tol
        self.residual_floor = residual_floor
        return self


def _check_common(max_iter: int, tol: float, momentum: float) -> None:
    check_count("max_iter", max_iter)
    if not (tol >= 0):
        raise ValueError(f"tol must be >= 0, got {tol}")
    # a negative momentum is a shift (A + |m| I), which 0.x users passed: any finite value
    if not math.isfinite(momentum):
        raise ValueError(f"momentum must be a finite number, got {momentum}")


def _power(
    apply: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    max_iter: int,
    tol: float,
    momentum: float,
    backend: LinAlgBackend,
    noise: float,
    bar: object | None,
) -> tuple[float, torch.Tensor, float, int, bool, float]:
    """The iteration on a unit row ``x (1, n)``; ``apply`` maps rows to rows."""
    prev = torch.zeros_like(x)
    lam = 0.0
    res = float("inf")
    converged = False
    it = 0
    anorm = 0.0
    for it in range(1, max_iter + 1):
        w = apply(x)
        rq = row_dots(backend, x, w)
        r = w - rq.unsqueeze(1) * x
        rn = row_dots(backend, r, r).sqrt()
        y = w - momentum * prev if momentum else w
        yn = row_dots(backend, y, y).sqrt()
        host = torch.cat([rq, rn, yn]).to("cpu", torch.float64).tolist()  # the one sync of the step
        lam, res, ynorm = host
        if not all(math.isfinite(h) for h in host):
            raise non_finite_error("power iteration", it)
        anorm = max(anorm, abs(lam))
        if bar is not None:
            bar.update(1)  # type: ignore[attr-defined]
        if res <= max(tol * abs(lam), noise * anorm):
            converged = True
            break
        if ynorm == 0.0:  # x is in the null space: λ = 0 exactly
            converged = True
            break
        if it == max_iter:  # keep x: the reported λ and residual are x's
            break
        prev = x / ynorm
        x = y / ynorm
    return lam, x, res, it, converged, noise * anorm


def _power_host(
    apply: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]],
    x: np.ndarray[Any, Any],
    *,
    max_iter: int,
    tol: float,
    momentum: float,
    noise: float,
    bar: object | None,
) -> tuple[float, np.ndarray[Any, Any], float, int, bool, float]:
    """``_power`` on a unit host vector ``x (n,)`` in numpy (``apply`` maps vectors to
    vectors): the same iteration and tests. See NOTE [small operators on the host]."""
    prev = np.zeros_like(x)
    lam = 0.0
    res = float("inf")
    converged = False
    it = 0
    anorm = 0.0
    for it in range(1, max_iter + 1):
        w = apply(x)
        lam = float(x @ w)
        r = w - lam * x
        res = math.sqrt(float(r @ r))
        y = w - momentum * prev if momentum else w
        ynorm = math.sqrt(float(y @ y))
        if not (math.isfinite(lam) and math.isfinite(res) and math.isfinite(ynorm)):
            raise non_finite_error("power iteration", it)
        anorm = max(anorm, abs(lam))
        if bar is not None:
            bar.update(1)  # type: ignore[attr-defined]
        if res <= max(tol * abs(lam), noise * anorm):
            converged = True
            break
        if ynorm == 0.0:  # x is in the null space: λ = 0 exactly
            converged = True
            break
        if it == max_iter:  # keep x: the reported λ and residual are x's
            break
        if momentum:
            prev = x / ynorm
        x = y / ynorm
    return lam, x, res, it, converged, noise * anorm


def power_iteration_one(
    op: CurvatureOperator,
    *,
    max_iter: int = 100,
    tol: float = 1e-4,
    momentum: float = 0.0,
    init: torch.Tensor | EigenResult | PowerIterationResult | None = None,
    seed: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
) -> PowerIterationResult:
    """The eigenpair of largest ``|λ|`` by power iteration.

    ``max_iter`` caps the products; ``tol`` is the relative residual (see the
    module docstring); ``init`` is a start vector ``(n,)`` (random from
    ``seed`` otherwise), or a warm start: a previous ``PowerIterationResult``,
    ``EigenResult`` (its pair of largest ``|λ|``) or basis ``(p, n)`` /
    ``(n, p)`` (its first vector); see NOTE [warm starts] in ``_common``. Returns ``(eigenvalue, eigenvector, residual,
    iterations, converged)``; does not warn when unconverged (read
    ``converged``).
    """
    op = check_operator(op)
    backend = operator_backend(op, backend)
    _check_common(max_iter, tol, momentum)
    wd = work_dtype(op, precision)
    op.expect_products(max_iter)
    x = _start(op, init, seed, backend, wd)
    noise = rounding_level(wd, op.dtype)
    with progress_bar(max_iter, "power iteration", progress) as bar:
        if host_arithmetic(x, backend):  # See NOTE [small operators on the host]
            lam, vh, res, it, conv, floor = _power_host(
                lambda z: host_matvec(op, z),
                x[0].numpy(),
                max_iter=max_iter,
                tol=tol,
                momentum=momentum,
                noise=noise,
                bar=bar,
            )
            v = torch.from_numpy(vh).unsqueeze(0)
        else:
            lam, v, res, it, conv, floor = _power(
                lambda z: apply_rows(op, z),
                x,
                max_iter=max_iter,
                tol=tol,
                momentum=momentum,
                backend=backend,
                noise=noise,
                bar=bar,
            )
    return PowerIterationResult(lam, v[0].to(op.dtype), res, it, conv, float(tol), floor)


def _start(
    op: CurvatureOperator,
    init: torch.Tensor | EigenResult | PowerIterationResult | None,
    seed: int | None,
    backend: LinAlgBackend,
    wd: torch.dtype,
) -> torch.Tensor:
    if isinstance(init, PowerIterationResult):
        init = init.eigenvector
    if isinstance(init, EigenResult) or (isinstance(init, torch.Tensor) and init.dim() == 2):
        rows = _warm_rows_by_magnitude(init, op.size, "init")
        init = None if rows is None else rows[0]
    if init is not None:
        if not isinstance(init, torch.Tensor):
            raise TypeError(f"init must be a torch.Tensor, got {type(init).__name__}")
        if init.numel() != op.size:
            raise ValueError(f"init must have {op.size} entries, got shape {tuple(init.shape)}")
        x = init.reshape(1, -1).to(device=op.device, dtype=wd)
    else:
        x = random_rows(1, op.size, make_generator(seed, backend), device=op.device, dtype=wd)
    nrm = float(row_dots(backend, x, x).sqrt())
    if not nrm > 0.0 or nrm == float("inf"):
        raise ValueError(
            "the start vector is zero or non-finite; pass a nonzero init or leave init=None"
        )
    return x / nrm


def _warm_rows_by_magnitude(v0: Any, n: int, name: str) -> torch.Tensor | None:
    """Warm-start rows (NOTE [warm starts]), a previous result's by ``|λ|`` descending: the
    order in which power iteration finds them."""
    rows = warm_start_rows(v0, n, name)
    if rows is not None and isinstance(v0, EigenResult):
        order = torch.argsort(-v0.eigenvalues.abs(), stable=True)
        rows = rows[order.to(rows.device)]
    return rows


def _deflated_host_run(
    op: CurvatureOperator,
    found: np.ndarray[Any, Any],
    x: np.ndarray[Any, Any],
    max_iter: int,
    tol: float,
    momentum: float,
    noise: float,
    bar: object,
) -> tuple[float, np.ndarray[Any, Any], int]:
    """One run of ``deflated_power_iteration`` in numpy on the host from the start vector
    ``x`` (projection deflation as on the device). Returns ``(λ, v, products)``.
    See NOTE [small operators on the host]."""

    def apply(z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if found.shape[0]:
            z = z - (found @ z) @ found
        w = host_matvec(op, z)
        if found.shape[0]:
            w = w - (found @ w) @ found
        return w

    if found.shape[0]:
        x = x - (found @ x) @ found
    x = x / math.sqrt(float(x @ x))
    lam, v, _res, it, _conv, _floor = _power_host(
        apply, x, max_iter=max_iter, tol=tol, momentum=momentum, noise=noise, bar=bar
    )
    return lam, v, it


def deflated_power_iteration(
    op: CurvatureOperator,
    *,
    k: int = 10,
    max_iter: int = 100,
    tol: float = 1e-4,
    momentum: float = 0.0,
    seed: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
    init: torch.Tensor | EigenResult | None = None,
) -> EigenResult:
    """``k`` eigenpairs of largest ``|λ|`` by power iteration with deflation.

    ``max_iter`` caps the products of each of the ``k`` runs. Results are
    sorted by eigenvalue, descending (as 0.x did). Residuals are the true
    ``||A v − λ v||`` on the original operator (one block product at the
    end), so errors of earlier pairs that leak through the deflation show.
    Warns :class:`ConvergenceWarning` when some pair misses ``tol``.
    ``init``: a warm start, the previous ``EigenResult`` (or a basis ``(p, n)``
    / ``(n, p)``): run ``i`` starts from its ``i``-th vector by ``|λ|`` (random
    beyond ``p``); see NOTE [warm starts] in ``_common``.
    """
    op = check_operator(op)
    backend = operator_backend(op, backend)
    n = op.size
    check_k(k, global_size(op))
    _check_common(max_iter, tol, momentum)
    op.expect_products(k * max_iter)
    wd = work_dtype(op, precision)
    noise = rounding_level(wd, op.dtype)
    gen = make_generator(seed, backend)
    warm = None if init is None else _warm_rows_by_magnitude(init, n, "init")
    if warm is not None:
        warm = warm.to(device=op.device, dtype=wd)
    U = torch.zeros(k, n, dtype=wd, device=op.device)
    lams = torch.zeros(k, dtype=torch.float64)
    products = 0
    Un = U.numpy() if host_arithmetic(U, backend) else None  # NOTE [small operators on the host]

    with progress_bar(k * max_iter, f"deflated power iteration (k={k})", progress) as bar:
        for i in range(k):
            found = U[:i]
            if Un is not None:
                xr = random_rows(1, n, gen, device=op.device, dtype=wd)
                xh = (warm[i : i + 1] if warm is not None and i < warm.shape[0] else xr)[0].numpy()
                lam, vh, it = _deflated_host_run(
                    op, Un[:i], xh, max_iter, tol, momentum, noise, bar
                )
                products += it
                Un[i] = vh
                lams[i] = lam
                continue

            def apply(z: torch.Tensor, found: torch.Tensor = found) -> torch.Tensor:
                # projection deflation P A P, P = I - UUᵀ: the iterate stays orthogonal to the
                # pairs found, so their residual errors do not leak in as they do with A - λuuᵀ
                if found.shape[0]:
                    z = z - backend.inner_rows(z, found) @ found
                w = apply_rows(op, z)
                if found.shape[0]:
                    w = w - backend.inner_rows(w, found) @ found
                return w

            x = random_rows(1, n, gen, device=op.device, dtype=wd)
            if warm is not None and i < warm.shape[0]:
                x = warm[i : i + 1]
            if i:
                x = x - backend.inner_rows(x, found) @ found
            x = x / row_dots(backend, x, x).sqrt().unsqueeze(1)
            lam, v, _res, it, _conv, _floor = _power(
                apply,
                x,
                max_iter=max_iter,
                tol=tol,
                momentum=momentum,
                backend=backend,
                noise=noise,
                bar=bar,
            )
            products += it
            U[i] = v[0]
            lams[i] = lam

    AU = apply_rows(op, U)
    products += k
    # Rayleigh-Ritz on span(U): the error of an early pair lies mostly along the next
    # eigenvectors (the slowest-decaying components), which span(U) contains; rotating
    # removes it at no extra product
    G = backend.inner_rows(U, AU).to("cpu", torch.float64)
    if not bool(torch.isfinite(G).all()):
        raise non_finite_error("residual check", products)
    lams, S = torch.linalg.eigh(0.5 * (G + G.T))
    St = S.T.to(device=op.device, dtype=wd)
    U, AU = St @ U, St @ AU
    R = AU - lams.to(device=op.device, dtype=wd).unsqueeze(1) * U
    res = row_dots(backend, R, R).sqrt().to("cpu", torch.float64)
    if not bool(torch.isfinite(res).all()):
        raise non_finite_error("residual check", products)
    anorm = float(lams.abs().max())
    converged = res <= torch.clamp(tol * lams.abs(), min=noise * anorm)
    order = torch.argsort(lams, descending=True, stable=True)
    if not bool(converged.all()):
        warn_convergence(
            f"deflated_power_iteration: {int(converged.sum())} of {k} eigenpairs reached tol={tol:g} "
            f"(max_iter={max_iter} products each); raise max_iter, or use lanczos"
        )
    return EigenResult(
        eigenvalues=lams[order],
        eigenvectors=U[order].to(op.dtype),
        residuals=res[order],
        iterations=products,
        converged=converged[order],
        tol=float(tol),
        residual_floor=noise * anorm,  # See NOTE [convergence rule] in result
    )
