"""Warm starts from a previous result (issue 19): same answers as a cold start, fewer products."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import (
    EigenResult,
    deflated_power_iteration,
    lanczos,
    power_iteration_one,
)
from tests.algorithms.spectra import CountingOp, dense_matrix, dense_op, spectrum

N, K = 300, 5


def _pair(kind: str, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """A dense float64 matrix A and A + eps ||A|| E (E symmetric, ||E||_2 = 1)."""
    # "geometric": a gap that power iteration resolves (ratio 0.8 between neighbours)
    eig = 10.0 * 0.8 ** np.arange(N) if kind == "geometric" else spectrum(kind, N)
    A = dense_matrix(eig)
    E = np.random.default_rng(1).standard_normal((N, N))
    E = (E + E.T) / 2
    E /= np.linalg.norm(E, 2)
    return A, A + eps * np.abs(eig).max() * E


def _top_lm(m: np.ndarray, k: int) -> np.ndarray:
    w = np.linalg.eigvalsh(m)
    return w[np.argsort(-np.abs(w), kind="stable")][:k]


def _check_pairs(m: np.ndarray, r: EigenResult, tol: float) -> None:
    lam = r.eigenvalues.numpy()
    np.testing.assert_allclose(lam, _top_lm(m, K), rtol=10 * tol)
    res = np.linalg.norm(r.eigenvectors.numpy() @ m - lam[:, None] * r.eigenvectors.numpy(), axis=1)
    assert np.all(res <= tol * np.abs(lam) * 1.01)


@pytest.mark.parametrize("kind", ["lowrank", "separated"])
def test_lanczos_warm_start_matches_cold_with_half_the_products(kind: str) -> None:
    A, B = _pair(kind, 1e-5)
    tol = 1e-4
    prev = lanczos(dense_op(A), k=K, tol=tol, seed=0)
    cold_op, warm_op = CountingOp(dense_op(B)), CountingOp(dense_op(B))
    cold = lanczos(cold_op, k=K, tol=tol, seed=0)
    warm = lanczos(warm_op, k=K, tol=tol, seed=0, v0=prev)
    _check_pairs(B, cold, tol)
    _check_pairs(B, warm, tol)
    assert warm.iterations == warm_op.num_matvecs
    assert warm_op.num_matvecs <= 0.5 * cold_op.num_matvecs, (
        warm_op.num_matvecs,
        cold_op.num_matvecs,
    )


def test_lanczos_warm_start_accepts_a_basis_either_way_round_and_is_reproducible() -> None:
    A, B = _pair("lowrank", 1e-5)
    prev = lanczos(dense_op(A), k=K, seed=0)
    runs = [
        lanczos(dense_op(B), k=K, v0=prev),
        lanczos(dense_op(B), k=K, v0=prev),
        lanczos(dense_op(B), k=K, v0=prev.eigenvectors),
        lanczos(dense_op(B), k=K, v0=prev.eigenvectors.T.contiguous()),
    ]
    for r in runs[1:]:
        assert r.iterations == runs[0].iterations
        assert torch.equal(r.eigenvalues, runs[0].eigenvalues)
        assert torch.equal(r.eigenvectors, runs[0].eigenvectors)


def test_lanczos_warm_block_start() -> None:
    A, B = _pair("lowrank", 1e-5)
    prev = lanczos(dense_op(A), k=K, seed=0)
    r = lanczos(dense_op(B), k=K, block_size=2, v0=prev)
    _check_pairs(B, r, 1e-4)


def test_bad_warm_starts() -> None:
    A, B = _pair("lowrank", 1e-5)
    prev = lanczos(dense_op(A), k=K, seed=0)
    small = dense_op(B[:100, :100])
    with pytest.raises(ValueError, match="v0"):
        lanczos(small, k=K, v0=prev)
    with pytest.raises(ValueError, match="v0"):
        lanczos(dense_op(B), k=K, v0=torch.zeros(3, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="init"):
        deflated_power_iteration(small, k=2, init=prev)
    with pytest.raises(ValueError, match="init"):
        power_iteration_one(small, init=prev)
    with pytest.raises(TypeError, match="v0"):
        lanczos(dense_op(B), k=K, v0=[1.0, 2.0])  # type: ignore[arg-type]
    # non-finite vectors: a warning, then exactly the cold start of the same seed
    Y = prev.eigenvectors.clone()
    Y[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="v0.*cold start"):
        fallback = lanczos(dense_op(B), k=K, seed=3, v0=Y)
    cold = lanczos(dense_op(B), k=K, seed=3)
    assert torch.equal(fallback.eigenvalues, cold.eigenvalues)
    assert fallback.iterations == cold.iterations
    # the 1.0 start block keeps its meaning and its errors
    with pytest.raises(ValueError, match="non-finite"):
        lanczos(dense_op(B), k=K, v0=torch.full((N,), float("nan"), dtype=torch.float64))


def test_power_iteration_warm_starts() -> None:
    A, B = _pair("geometric", 1e-5)
    prev1 = power_iteration_one(dense_op(A), max_iter=500, tol=1e-6, seed=0)
    cold = power_iteration_one(dense_op(B), max_iter=500, tol=1e-6, seed=0)
    warm = power_iteration_one(dense_op(B), max_iter=500, tol=1e-6, init=prev1)
    assert cold.converged and warm.converged
    top = _top_lm(B, 1)[0]
    assert abs(warm.eigenvalue - top) <= 1e-5 * abs(top)
    assert warm.iterations <= 0.5 * cold.iterations, (warm.iterations, cold.iterations)

    prev = deflated_power_iteration(dense_op(A), k=3, max_iter=500, tol=1e-6, seed=0)
    cold_k = deflated_power_iteration(dense_op(B), k=3, max_iter=500, tol=1e-6, seed=0)
    warm_k = deflated_power_iteration(dense_op(B), k=3, max_iter=500, tol=1e-6, seed=0, init=prev)
    want = np.sort(_top_lm(B, 3))[::-1]
    np.testing.assert_allclose(warm_k.eigenvalues.numpy(), want, rtol=1e-5)
    assert warm_k.iterations <= 0.5 * cold_k.iterations, (warm_k.iterations, cold_k.iterations)
    # a basis (n, p) works like the result it came from, and an EigenResult from lanczos too
    from_lanczos = lanczos(dense_op(A), k=3, seed=0)
    w2 = power_iteration_one(dense_op(B), max_iter=500, tol=1e-6, init=from_lanczos)
    w3 = power_iteration_one(dense_op(B), max_iter=500, tol=1e-6, init=from_lanczos.eigenvectors.T)
    assert w2.iterations == w3.iterations and w2.iterations <= 0.5 * cold.iterations
