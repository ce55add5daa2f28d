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
    check_float,
    check_int,
    core_convergence_warning_off,
    init_vector,
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
    k = check_int("num_eigenthings", num_eigenthings, minimum=1, hint="1.0: lanczos(op, k=...)")
    if k > n:
        raise ValueError(
            f"num_eigenthings={k} must be at most the operator size {n} (1.0: lanczos(op, k=...))"
        )
    if which not in _CORE_WHICH + _ARPACK_ONLY:
        raise ValueError(
            f"which must be one of 'LM', 'SM', 'LA', 'SA', 'BE', got {which!r} (1.0: which='LM'|'LA'|'SA')"
        )
    restarts = check_int(
        "max_steps",
        max_steps,
        minimum=1,
        hint="ARPACK restarts; 1.0: lanczos(op, max_iter=<products>)",
    )
    tol = check_float("tol", tol, minimum=0.0, hint="1.0: lanczos(op, tol=...), same meaning")
    if num_lanczos_vectors is None:
        ncv = min(n, max(2 * k + 1, 20))  # eigsh's default
    else:
        ncv = check_int(
            "num_lanczos_vectors", num_lanczos_vectors, minimum=1, hint="1.0: lanczos(op, ncv=...)"
        )
        if not k < ncv <= n and not (ncv == k == n):
            raise ValueError(
                f"num_lanczos_vectors must satisfy num_eigenthings < num_lanczos_vectors <= operator size, "
                f"got {ncv} with num_eigenthings={k}, size={n} (1.0: lanczos(op, k=..., ncv=...))"
            )
    v0 = init_vector(init_vec, op, "init_vec")

    if which in _ARPACK_ONLY:
        from scipy.sparse.linalg import eigsh

        start = None if v0 is None else as_numpy(v0.to(torch.float64))
        evals, evecs = eigsh(
            op.to_scipy(), k=k, which=which, maxiter=restarts, tol=tol, ncv=ncv, v0=start
        )
        return evals, np.ascontiguousarray(evecs.T)

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
        )
    warn_unconverged(
        "lanczos",
        result.converged,
        f"max_steps={restarts} restarts with num_lanczos_vectors={ncv} ran out before tol={tol:g} "
        "(0.x raised ArpackNoConvergence); raise max_steps or num_lanczos_vectors",
    )
    values, vectors = sorted_pairs(result.eigenvalues, result.eigenvectors, descending=False)
    return as_numpy(values), as_numpy(vectors)
