"""Lanczos never spends more products than ARPACK (scipy's eigsh) on the test spectra.

Same operator, same start vector, same relative tolerance (ARPACK's test is
``||r|| <= tol · |θ|`` on its Ritz estimates, as ours with ``residuals="estimate"``).
The default (``residuals="recorded"``, NOTE [recorded residuals]) computes the residuals from
the products made and spends exactly what ``"estimate"`` does; ``residuals="exact"`` adds the
k products of recomputing them, which ARPACK does not do. Product counts are exact, noise-free.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla
import torch

from hessian_eigenthings.algorithms import lanczos
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix, spectrum

N = 300


def _arpack_products(m: np.ndarray, k: int, which: str, tol: float, v0: np.ndarray) -> int:
    count = [0]

    def matvec(x: np.ndarray) -> np.ndarray:
        count[0] += 1
        return m @ x

    sla.eigsh(sla.LinearOperator(m.shape, matvec=matvec, dtype=np.float64), k=k, which=which, tol=tol, v0=v0)
    return count[0]


@pytest.mark.parametrize("kind", ["clustered", "powerlaw", "separated", "indefinite"])
@pytest.mark.parametrize("k", [3, 6])
@pytest.mark.parametrize("which", ["LM", "LA"])
def test_never_more_products_than_arpack(kind: str, k: int, which: str) -> None:
    m = dense_matrix(spectrum(kind, N, seed=0), seed=1)
    a = torch.as_tensor(m)
    v0 = np.random.default_rng(0).standard_normal(N)
    for tol in (1e-4, 1e-6):
        arpack = _arpack_products(m, k, which, tol, v0)
        op = LambdaOperator(lambda v: a @ v, N, dtype=torch.float64)
        est = lanczos(op, k=k, which=which, tol=tol, v0=torch.as_tensor(v0), residuals="estimate")
        assert bool(est.converged.all())
        assert op.num_matvecs == est.iterations <= arpack, (tol, est.iterations, arpack)
        default = lanczos(LambdaOperator(lambda v: a @ v, N, dtype=torch.float64), k=k, which=which,
                          tol=tol, v0=torch.as_tensor(v0))
        assert default.iterations == est.iterations and bool(default.converged.all())
        exact = lanczos(LambdaOperator(lambda v: a @ v, N, dtype=torch.float64), k=k, which=which, tol=tol,
                        v0=torch.as_tensor(v0), residuals="exact")
        assert exact.iterations == est.iterations + k
        # and the eigenvalues are ARPACK's / numpy's
        w = np.linalg.eigvalsh(m)
        order = np.argsort(-np.abs(w)) if which == "LM" else np.argsort(-w)
        np.testing.assert_allclose(np.sort(est.eigenvalues.numpy()), np.sort(w[order[:k]]), rtol=10 * tol)
