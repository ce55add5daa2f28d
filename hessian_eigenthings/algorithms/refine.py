"""Refinement of approximate eigenpairs, and Lanczos in TF32 finished in fp32.

Math. Given approximate eigenvectors ``Y (k, n)`` of a symmetric ``A``, the
refinement is a block Krylov (Davidson without preconditioner) iteration:
Rayleigh–Ritz on the span of ``Y`` gives Ritz pairs ``(θ, y)`` and residuals
``R = A Y - θ Y``; the residuals of the pairs that miss ``tol``, made
orthogonal to the basis, extend it, and Rayleigh–Ritz runs again on the larger
basis. Each iteration costs one product per unconverged pair; the basis grows to
``span{Y, AY, A²Y, ...}`` and converges like block Lanczos started from ``Y``:
a few iterations when ``Y`` is already close (the Ritz vectors of a TF32 run,
whose products are ~1e-3 off). Past ``max_basis`` vectors the basis restarts
from the current Ritz vectors. The basis and ``A Z`` are kept (``2 · max_basis``
vectors); Rayleigh–Ritz is a small float64 ``eigh`` on the host.

``lanczos_tf32_refine`` runs :func:`~hessian_eigenthings.algorithms.lanczos`
with TF32 products (on CUDA, 1.6-2.3x faster for fp32 models) on its residual
estimates, then this refinement with fp32 products, so the reported
eigenvalues and residuals are fp32-accurate. See NOTE [tf32 then refine].
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.algorithms._common import (
    apply_rows,
    check_operator,
    non_finite_error,
    operator_backend,
    orthonormalize_rows,
    rounding_level,
    row_dots,
    work_dtype,
)
from hessian_eigenthings.algorithms.krylov import ritz_order
from hessian_eigenthings.algorithms.lanczos import lanczos
from hessian_eigenthings.algorithms.result import (
    EigenResult,
    quiet_convergence_warnings,
    warn_convergence,
)
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = ["lanczos_tf32_refine", "refine_eigenpairs"]

Which = Literal["LM", "LA", "SA"]


def refine_eigenpairs(
    op: CurvatureOperator,
    start: EigenResult | torch.Tensor,
    *,
    which: Which = "LM",
    tol: float = 1e-6,
    max_iter: int | None = None,
    max_basis: int | None = None,
    backend: LinAlgBackend | None = None,
) -> EigenResult:
    """Eigenpairs of ``op`` refined from approximate ones, to ``||A y - θ y|| <= tol·|θ|``
    (or the rounding floor: NOTE [convergence rule] in ``result``).

    Args:
        start: an ``EigenResult`` (its eigenvectors) or rows ``(k, n)`` spanning the
            approximate eigenvectors; ``k`` pairs come back, most wanted first.
        which: which of the Ritz pairs of the growing basis are wanted.
        max_iter: product budget (default ``20 · k``); the ``k`` products of the first
            Rayleigh–Ritz count.
        max_basis: basis size before a restart from the current Ritz vectors
            (default ``max(4k, k + 20)``, at most the operator size).

    ``EigenResult.iterations`` counts the products of the refinement only; the
    residuals are true residuals of the returned pairs (no extra product).
    """
    op = check_operator(op)
    if which not in ("LM", "LA", "SA"):
        raise ValueError(f"which must be 'LM', 'LA' or 'SA', got {which!r}")
    if not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and tol >= 0):
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    Y0 = start.eigenvectors if isinstance(start, EigenResult) else start
    if not isinstance(Y0, torch.Tensor) or Y0.dim() != 2 or Y0.shape[1] != op.size:
        raise ValueError(
            f"start must be an EigenResult or a (k, {op.size}) tensor of rows, got "
            f"{tuple(Y0.shape) if isinstance(Y0, torch.Tensor) else type(Y0).__name__}"
        )
    k = int(Y0.shape[0])
    n = op.size
    max_iter = check_count("max_iter", max_iter, allow_none=True) or 20 * k
    max_basis = check_count("max_basis", max_basis, allow_none=True) or max(4 * k, k + 20)
    max_basis = min(max(max_basis, 2 * k), n)
    backend = operator_backend(op, backend)
    wd = work_dtype(op, None)
    noise = rounding_level(wd, op.dtype)
    Y = orthonormalize_rows(Y0.detach().to(device=op.device, dtype=wd), backend)
    if Y.shape[0] < k:
        raise ValueError(f"start has rank {Y.shape[0]} < k = {k}: its rows must be independent")
    if not bool(torch.isfinite(Y).all()):
        raise ValueError("start contains non-finite values")

    Z, AZ = Y, apply_rows(op, Y)
    products = k
    it = 0
    while True:
        it += 1
        if not bool(torch.isfinite(AZ).all()):
            raise non_finite_error("refinement", it)
        H = backend.inner_rows(Z, AZ).to("cpu", torch.float64).numpy()
        theta, S = np.linalg.eigh(0.5 * (H + H.T))
        want = ritz_order(theta, which)[:k]
        Sw = torch.from_numpy(np.ascontiguousarray(S[:, want].T)).to(device=Z.device, dtype=wd)
        Y, AY = Sw @ Z, Sw @ AZ
        lam = torch.from_numpy(theta[want].copy())
        R = AY - lam.to(device=Y.device, dtype=wd).unsqueeze(1) * Y
        res = row_dots(backend, R, R).clamp_min(0).sqrt().to("cpu", torch.float64)
        anorm = float(np.abs(theta).max())
        thresh = torch.clamp(tol * lam.abs(), min=noise * anorm)
        converged = res <= thresh
        open_rows = (~converged).nonzero().flatten().tolist()
        if not open_rows or products >= max_iter:
            break
        m = min(len(open_rows), max_iter - products)
        if Z.shape[0] + m > max_basis:
            Z, AZ = Y, AY  # restart from the current Ritz vectors (orthonormal: S is)
        W = R[open_rows[:m]]
        for _ in range(2):
            W = W - backend.inner_rows(W, Z) @ Z
        W = orthonormalize_rows(W, backend, rtol=float(torch.finfo(wd).eps) ** 0.5)
        if W.shape[0] == 0:  # the residuals lie in the basis already: nothing more to gain
            break
        products += W.shape[0]
        Z, AZ = torch.cat([Z, W]), torch.cat([AZ, apply_rows(op, W)])
    if not bool(converged.all()):
        warn_convergence(
            f"refine_eigenpairs: {int(converged.sum())} of {k} eigenpairs converged to tol={tol:g} "
            f"within {products} products; raise max_iter, or loosen tol"
        )
    return EigenResult(
        eigenvalues=lam,
        eigenvectors=Y.to(op.dtype),
        residuals=res,
        iterations=products,
        converged=converged,
        tol=float(tol),
        residual_floor=noise * anorm,  # See NOTE [convergence rule] in result
    )


# NOTE [tf32 then refine]
# TF32 products of an fp32 model are 1.6-2.3x faster on an H100 and ~1e-3 off (GPT-2 6L: 9e-4,
# ResNet-18: 2e-2 relative). The rounding of their inputs makes them no fixed linear map, so
# the true residuals of a TF32 run stay near the products' error, while the residual
# estimates of the Krylov recurrence keep falling: a TF32 lanczos to tf32_tol (default the
# user's tol, at most 1e-4) stops normally and leaves Ritz vectors as good as TF32 allows.
# refine_eigenpairs then takes them with fp32 products: one Rayleigh-Ritz (k products) gives
# eigenvalues accurate to about the square of the vectors' error, and a few block expansions
# bring the true residuals to tol. On a model of TF32 (tests/algorithms/test_refine.py:
# inputs rounded to 11 bits; 4 spectra, n = 400, k = 5, tol 1e-3 / 1e-4), counting a TF32
# product as 0.6 of an fp32 one, the run cost 0.62-0.77 of a cold fp32 lanczos (mean 0.69);
# stopping the TF32 phase at 1e-2 instead cost 1.44 (the block refinement then does most of
# the work, in fp32). The eigenvalues and residuals reported are those of fp32 products; the
# product count is the sum of both phases. Only operators with a `precision` switch (the data
# operators: "fp32" / "tf32") take part; the switch is restored afterwards, on exceptions
# too. On a CPU, or for a float64 operator, TF32 does nothing and the first phase is an
# ordinary lanczos.


@contextlib.contextmanager
def _precision(op: CurvatureOperator, precision: str) -> Iterator[None]:
    saved = op.precision  # type: ignore[attr-defined]
    op.precision = precision  # type: ignore[attr-defined]
    try:
        yield
    finally:
        op.precision = saved  # type: ignore[attr-defined]


def lanczos_tf32_refine(
    op: CurvatureOperator,
    k: int = 6,
    *,
    which: Which = "LM",
    tol: float = 1e-6,
    tf32_tol: float | None = None,
    max_iter: int | None = None,
    refine_max_iter: int | None = None,
    seed: int | None = 0,
    backend: LinAlgBackend | None = None,
    **lanczos_options: Any,
) -> EigenResult:
    """Top-``k`` eigenpairs with a Lanczos run in TF32 finished by fp32 refinement.

    See NOTE [tf32 then refine]. ``op`` must have a ``precision`` attribute
    (``"fp32"``/``"tf32"``: the data operators); other keyword arguments go to
    :func:`~hessian_eigenthings.algorithms.lanczos`. ``iterations`` of the
    result counts the products of both phases.
    """
    op = check_operator(op)
    if not hasattr(op, "precision"):
        raise TypeError(
            f"{type(op).__name__} has no precision switch: TF32-then-refine needs a data operator "
            "(HessianOperator, GGNOperator, EmpiricalFisherOperator, ...)"
        )
    if tf32_tol is None:
        tf32_tol = max(tol, 1e-4)
    if not (isinstance(tf32_tol, (int, float)) and tf32_tol > 0):
        raise ValueError(f"tf32_tol must be a positive number or None, got {tf32_tol!r}")
    # the first phase may stop short of tf32_tol: the second phase is what is reported
    with _precision(op, "tf32"), quiet_convergence_warnings():
        rough = lanczos(
            op,
            k=k,
            which=which,
            tol=tf32_tol,
            max_iter=max_iter,
            seed=seed,
            backend=backend,
            residuals="estimate",
            **lanczos_options,
        )
    with _precision(op, "fp32"):
        fine = refine_eigenpairs(
            op, rough, which=which, tol=tol, max_iter=refine_max_iter, backend=backend
        )
    return EigenResult(
        eigenvalues=fine.eigenvalues,
        eigenvectors=fine.eigenvectors,
        residuals=fine.residuals,
        iterations=rough.iterations + fine.iterations,
        converged=fine.converged,
        tol=fine.tol,
        residual_floor=fine.residual_floor,
    )
