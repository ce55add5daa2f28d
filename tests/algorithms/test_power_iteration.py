"""Power iteration and deflation against numpy.linalg.eigh."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import (
    ConvergenceWarning,
    deflated_power_iteration,
    power_iteration_one,
)
from tests.algorithms.spectra import CountingOp, dense_matrix, dense_op, diag_op


def test_power_iteration_one_matches_eigh() -> None:
    eigs = np.concatenate([[5.0, -2.0], np.linspace(1.0, 0.0, 48)])
    m = dense_matrix(eigs, seed=0)
    lam, vec, res, it, conv = power_iteration_one(dense_op(m), max_iter=200, tol=1e-8, seed=0)
    assert lam == pytest.approx(5.0, rel=1e-12)
    v = vec.numpy()
    true_res = np.linalg.norm(m @ v - lam * v)
    assert res == pytest.approx(true_res, rel=1e-6, abs=1e-14)
    assert conv and true_res <= 1e-8 * 5.0
    assert 1 < it <= 200


def test_momentum_speeds_up_a_small_gap() -> None:
    d = np.concatenate([[1.0, 0.98], np.linspace(0.9, 0.0, 998)])
    plain = power_iteration_one(diag_op(d), max_iter=3000, tol=1e-6, seed=0)
    # De Sa et al.: beta = lambda_2^2 / 4 is the optimal momentum
    fast = power_iteration_one(diag_op(d), max_iter=3000, tol=1e-6, seed=0, momentum=0.98**2 / 4)
    assert plain.converged and fast.converged
    assert fast.eigenvalue == pytest.approx(1.0, rel=1e-6)
    assert fast.iterations < plain.iterations / 2


def test_unconverged_is_reported() -> None:
    d = np.linspace(1.0, 0.99, 200)
    out = power_iteration_one(diag_op(d), max_iter=5, tol=1e-10, seed=0)
    assert not out.converged and out.iterations == 5
    v = out.eigenvector.numpy()
    assert out.residual == pytest.approx(np.linalg.norm(d * v - out.eigenvalue * v), rel=1e-6)


def test_init_vector_and_errors() -> None:
    m = dense_matrix(np.linspace(3.0, 1.0, 10), seed=1)
    init = torch.as_tensor(np.linalg.eigh(m)[1][:, -1])
    out = power_iteration_one(dense_op(m), init=init, tol=1e-10)
    assert out.iterations == 1 and out.eigenvalue == pytest.approx(3.0)
    with pytest.raises(ValueError, match="start vector is zero"):
        power_iteration_one(dense_op(m), init=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_iter must be"):
        power_iteration_one(dense_op(m), max_iter=0)


def test_deflated_power_iteration_sorted_descending() -> None:
    eigs = np.concatenate([[6.0, -4.0, 3.0], np.linspace(1.0, 0.0, 47)])
    m = dense_matrix(eigs, seed=2)
    op = CountingOp(torch.as_tensor(m))
    res = deflated_power_iteration(op, k=3, max_iter=400, tol=1e-9, seed=0)
    np.testing.assert_allclose(res.eigenvalues.numpy(), [6.0, 3.0, -4.0], rtol=1e-8)
    vecs = res.eigenvectors.numpy()
    true_res = np.linalg.norm(vecs @ m - res.eigenvalues.numpy()[:, None] * vecs, axis=1)
    np.testing.assert_allclose(res.residuals.numpy(), true_res, rtol=1e-6, atol=1e-14)
    assert res.converged.all()
    assert res.iterations == op.num_matvecs


def test_deflated_unconverged_warns_and_is_honest() -> None:
    d = np.linspace(1.0, 0.95, 300)
    with pytest.warns(ConvergenceWarning, match="deflated_power_iteration"):
        res = deflated_power_iteration(diag_op(d), k=2, max_iter=10, tol=1e-10, seed=0)
    assert not res.converged.any()
    assert res.iterations == 2 * 10 + 2


def test_seed_reproducible() -> None:
    m = dense_matrix(np.concatenate([[2.0, 1.5], np.linspace(1.0, 0.0, 18)]), seed=3)
    a = deflated_power_iteration(dense_op(m), k=2, max_iter=50, tol=1e-6, seed=4)
    b = deflated_power_iteration(dense_op(m), k=2, max_iter=50, tol=1e-6, seed=4)
    assert torch.equal(a.eigenvectors, b.eigenvectors)
