"""0.x ``lanczos``: ARPACK conventions on top of the 1.0 restarted Lanczos.

0.x handed the operator to ``scipy.sparse.linalg.eigsh``; the arguments keep
ARPACK's meaning and translate to the 1.0 solver (thick restart, which is
mathematically ARPACK's implicit restart with exact shifts):

- ``num_lanczos_vectors`` is ``ncv`` (default, as in eigsh:
  ``min(n, max(2k + 1, 20))``);
- ``max_steps`` counts restarts; the 1.0 ``max_iter`` counts products, and
  ARPACK spends ``ncv`` products on the first cycle and ``ncv - k`` on each
  restart, so ``max_iter = ncv + max_steps · (ncv - k)``;
- ``tol`` has the same meaning in both: ``||A v - θ v|| <= tol · |θ|``;
- results come back as eigsh returns them: eigenvalues ascending, the
  eigenvectors as rows ``(k, n)``, numpy arrays.

``which="SM"`` and ``"BE"`` (ARPACK modes the 1.0 solver does not offer) go
to ``eigsh`` on ``op.to_scipy()``, exactly as 0.x did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hessian_eigenthings.algorithms.lanczos import lanczos as core_lanczos
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
    warn_unconverged,
)

_CORE_WHICH = ("LM", "LA", "SA")
_ARPACK_ONLY = ("SM", "BE")


def lanczos(
    operator: Any,
    num_eigenthings: int = 10,
    which: str = "LM",
    max_steps: int = 20,
    tol: float = 1e-6,
    num_lanczos_vectors: int | None = None,
    init_vec: Any = None,
    use_gpu: bool = False,
    fp16: bool = False,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """0.x Lanczos. Deprecated: use ``lanczos(op, k=..., which=..., ...)`` (1.0, returns an EigenResult).

    Returns ``(eigenvalues (k,), eigenvectors (k, n))`` as numpy arrays,
    eigenvalues in ascending order (ARPACK's convention).
    """
    warn_deprecated("lanczos")
    return run_lanczos(
        operator,
        num_eigenthings,
        which,
        max_steps,
        tol,
        num_lanczos_vectors,
        init_vec,
        use_gpu,
        fp16,
    )


def run_lanczos(
    operator: Any,
    num_eigenthings: int = 10,
    which: str = "LM",
    max_steps: int = 20,
    tol: float = 1e-6,
    num_lanczos_vectors: int | None = None,
    init_vec: Any = None,
    use_gpu: bool = False,
    fp16: bool = False,
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The body of 0.x ``lanczos`` without the warning (``compute_hessian_eigenthings`` calls it)."""
    op = as_core_operator(operator, use_gpu=use_gpu, fp16=fp16, what="lanczos")
    n = op.size
    k = count("num_eigenthings", num_eigenthings, hint="1.0: lanczos(op, k=...)")
    if not 0 < k <= n:
        raise ValueError(
            f"num_eigenthings={k} must be between 1 and the operator size {n} (0.x's eigsh "
            "raised here too; 1.0: lanczos(op, k=...))"
        )
    if which not in _CORE_WHICH + _ARPACK_ONLY:
        raise ValueError(
            f"which must be one of 'LM', 'SM', 'LA', 'SA', 'BE', got {which!r} (0.x's eigsh raised "
            "ValueError too; 1.0: which='LM'|'LA'|'SA')"
        )
    restarts = count(
        "max_steps", max_steps, hint="ARPACK restarts; 1.0: lanczos(op, max_iter=<products>)"
    )
    if restarts < 1:
        raise ValueError(
            f"max_steps must be >= 1, got {restarts} (0.x's eigsh raised ValueError too; "
            "1.0: lanczos(op, max_iter=<products>))"
        )
    tol = real("tol", tol, hint="1.0: lanczos(op, tol=...), same meaning")
    tol = max(tol, 0.0)  # ARPACK takes tol <= 0 as machine precision, as the core takes 0
    if num_lanczos_vectors is None:
        ncv = min(n, max(2 * k + 1, 20))  # eigsh's default; see the module docstring
    else:
        ncv = count("num_lanczos_vectors", num_lanczos_vectors, hint="1.0: lanczos(op, ncv=...)")
        if not k < ncv <= n and not (ncv == k == n):
            raise ValueError(
                f"num_lanczos_vectors must satisfy num_eigenthings < num_lanczos_vectors <= operator size, "
                f"got {ncv} with num_eigenthings={k}, size={n} (0.x's eigsh raised ValueError too; "
                "1.0: lanczos(op, k=..., ncv=...))"
            )
    v0 = init_vector(init_vec, op, "init_vec")
    # 0.x's eigsh saw a float32 operator (its products went through maybe_fp16) and returned
    # float32 arrays; with fp16=True scipy upcast the half products and returned float64.
    # A float64 operator keeps float64 (0.x cut it to float32: the facade keeps the precision).
    half = op.dtype == torch.float16
    out_dtype = np.float64 if half or op.dtype == torch.float64 else np.float32

    if which in _ARPACK_ONLY:
        from scipy.sparse.linalg import eigsh

        start = None if v0 is None else as_numpy(v0.to(torch.float64))
        evals, evecs = eigsh(
            op.to_scipy(), k=k, which=which, maxiter=restarts, tol=tol, ncv=ncv, v0=start
        )
        return evals.astype(out_dtype), np.ascontiguousarray(evecs.T, dtype=out_dtype)

    # NOTE [0.x lanczos convergence]
    # ARPACK judged convergence by the Ritz estimates ||beta_m s_last||, never by recomputed
    # residuals, and was silent when they met tol; it raised ArpackNoConvergence otherwise.
    # The core's residuals="estimate" is that same criterion (and saves the k products of
    # the recomputation), so the facade is silent where 0.x was silent, and warns (in 0.x
    # words, at the user's line) where 0.x raised.
    with core_convergence_warning_off():
        result = core_lanczos(
            op,
            k=k,
            which=which,  # type: ignore[arg-type]
            tol=tol,
            ncv=ncv,
            max_iter=ncv + restarts * max(1, ncv - k),
            v0=v0,
            seed=None if v0 is not None else seed_from_global_rng(),
            residuals="estimate",
        )
    warn_unconverged(
        "lanczos",
        result.converged,
        f"max_steps={restarts} restarts with num_lanczos_vectors={ncv} ran out before tol={tol:g} "
        "(0.x raised ArpackNoConvergence); raise max_steps or num_lanczos_vectors",
    )
    values, vectors = sorted_pairs(result.eigenvalues, result.eigenvectors, descending=False)
    return as_numpy(values).astype(out_dtype), as_numpy(vectors).astype(out_dtype, copy=False)
