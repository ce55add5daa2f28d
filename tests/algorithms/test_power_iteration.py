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
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import (
    CountingOp,
    TorchOnlyBackend,
    dense_matrix,
    dense_op,
    diag_op,
    random_orthogonal,
)


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


def test_host_and_torch_arithmetic_agree() -> None:
    """Small CPU operators iterate in numpy on the host (NOTE [small operators on the host]);
    a backend other than the single-device one keeps the iteration in torch. Same iterates."""
    m = dense_matrix(np.concatenate([[6.0, -4.0, 3.0], np.linspace(1.0, 0.0, 47)]), seed=2)
    kw = dict(max_iter=400, tol=1e-9, seed=0)
    host = deflated_power_iteration(dense_op(m), k=3, **kw)  # type: ignore[arg-type]
    dev = deflated_power_iteration(dense_op(m), k=3, backend=TorchOnlyBackend(), **kw)  # type: ignore[arg-type]
    assert host.iterations == dev.iterations
    np.testing.assert_allclose(host.eigenvalues.numpy(), dev.eigenvalues.numpy(), rtol=1e-12)
    np.testing.assert_allclose(host.eigenvalues.numpy(), [6.0, 3.0, -4.0], rtol=1e-8)
    one_h = power_iteration_one(dense_op(m), **kw)  # type: ignore[arg-type]
    one_d = power_iteration_one(dense_op(m), backend=TorchOnlyBackend(), **kw)  # type: ignore[arg-type]
    assert one_h.iterations == one_d.iterations and one_h.converged
    assert one_h.eigenvalue == pytest.approx(one_d.eigenvalue, rel=1e-12)
    assert one_h.eigenvalue == pytest.approx(6.0, rel=1e-12)


@pytest.mark.parametrize("backend", [None, TorchOnlyBackend()])
def test_deflation_products_are_pinned(backend: object) -> None:
    """compat/custom_operator.py's low-rank-plus-diagonal operator in float64: host (numpy)
    and torch arithmetic spend the same products, one per step plus the final block of k."""
    u = torch.as_tensor(random_orthogonal(60, seed=4)[:, :4])
    s = torch.tensor([10.0, 6.0, 3.0, 1.5], dtype=torch.float64)
    op = LambdaOperator(lambda v: u @ (s * (u.T @ v)) + 0.1 * v, 60, dtype=torch.float64)
    res = deflated_power_iteration(op, k=3, max_iter=200, tol=1e-4, seed=0, backend=backend)  # type: ignore[arg-type]
    assert res.iterations == 57 == op.num_matvecs
    assert res.converged.all()
    np.testing.assert_allclose(res.eigenvalues.numpy(), [10.1, 6.1, 3.1], rtol=1e-7)


def test_deflation_of_an_exactly_low_rank_operator() -> None:
    """Runs past the rank find the deflated zero operator; the full spectrum is right."""
    q = random_orthogonal(8, seed=1)[:, :2]
    m = (q * np.array([5.0, -2.0])) @ q.T
    res = deflated_power_iteration(dense_op(m), k=4, max_iter=100, tol=1e-8, seed=0)
    np.testing.assert_allclose(res.eigenvalues.numpy(), [5.0, 0.0, 0.0, -2.0], atol=1e-12)
    assert res.converged.all()
