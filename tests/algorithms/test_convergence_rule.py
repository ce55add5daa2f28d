"""``converged`` is exactly the documented rule, and the result carries what it used.

Issue 25: on the CLI's problem, ``lanczos(op, k=5, which="SA", tol=1e-4)`` flagged a pair at
6.5e-4 relative residual as converged, with nothing saying why (a rounding floor applied). Every
eigensolver now returns ``tol`` and ``residual_floor`` and flags a pair converged exactly when
``residual <= max(tol · |λ|, residual_floor)`` (NOTE [convergence rule]); the residuals are the
true ones (checked against numpy in float64). The problem here has the CLI problem's shape: a
float32 operator whose wanted eigenvalues (the bottom, ~3e-3 to 6e-3) are small next to
``||A|| = 0.163``, so the floor is above ``tol · |λ|``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch

import hessian_eigenthings as he
from hessian_eigenthings.algorithms import (
    EigenResult,
    deflated_power_iteration,
    lanczos,
    power_iteration_one,
    refine_eigenpairs,
)
from hessian_eigenthings.algorithms._common import rounding_level
from tests.algorithms.spectra import dense_matrix, dense_op

N = 300
NORM = 0.163
TOL = 1e-4


def _matrix() -> np.ndarray:
    rest = np.random.default_rng(0).uniform(-2.5e-3, 0.05, N - 6)
    eigs = np.concatenate([np.linspace(-6e-3, -2.9e-3, 5), rest, [NORM]])
    return dense_matrix(eigs, seed=3).astype(np.float32).astype(np.float64)  # what float32 holds


def _true_residuals(m: np.ndarray, res: EigenResult) -> np.ndarray:
    Y = res.eigenvectors.to(torch.float64).numpy()
    lam = res.eigenvalues.numpy()
    Y = Y / np.linalg.norm(Y, axis=1, keepdims=True)
    return np.linalg.norm(Y @ m - lam[:, None] * Y, axis=1)


SOLVERS: dict[str, Callable[[he.LambdaOperator], EigenResult]] = {
    "lanczos": lambda op: lanczos(op, k=5, which="SA", tol=TOL, seed=0),
    "block_lanczos": lambda op: lanczos(op, k=5, which="SA", tol=TOL, seed=0, block_size=4),
    "top_level": lambda op: he.lanczos(op, k=5, which="SA", tol=TOL, seed=0),
    "refine": lambda op: refine_eigenpairs(
        op, lanczos(op, k=5, which="SA", tol=1e-2, seed=0), which="SA", tol=TOL
    ),
    # the top of the spectrum: the floor is below tol · |λ| there, the rule still exact
    "deflated_power": lambda op: deflated_power_iteration(op, k=2, tol=TOL, max_iter=400, seed=0),
}


@pytest.mark.parametrize("name", list(SOLVERS))
def test_converged_is_exactly_the_rule_the_result_carries(name: str) -> None:
    m = _matrix()
    op = dense_op(m, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", he.ConvergenceWarning)
        res = SOLVERS[name](op)
    assert res.tol == TOL
    level = rounding_level(torch.float32, torch.float32)
    # the floor is the rounding level times the solver's estimate of ||A||
    assert 0.5 * NORM * level <= res.residual_floor <= 1.001 * NORM * level
    thresh = torch.clamp(TOL * res.eigenvalues.abs(), min=res.residual_floor)
    assert torch.equal(res.converged, res.residuals <= thresh)
    # and the residuals are the true ones (float64 reference), to the rounding level
    np.testing.assert_allclose(
        res.residuals.numpy(), _true_residuals(m, res), rtol=0.05, atol=0.05 * res.residual_floor
    )


def test_pairs_accepted_by_the_floor_are_marked() -> None:
    op = dense_op(_matrix(), dtype=torch.float32)
    res = lanczos(op, k=5, which="SA", tol=TOL, seed=0)
    by_floor = res.floor_only()
    assert bool(by_floor.any())  # this problem has them (as the CLI's has)
    rel = res.residuals / res.eigenvalues.abs()
    assert torch.equal(by_floor, res.converged & (rel > TOL))
    rows = res.summary().splitlines()
    for i in range(5):
        assert rows[2 + i].endswith("True (floor)") == bool(by_floor[i]), rows[2 + i]
    assert f"tol={TOL:g}" in rows[-1] and f"floor={res.residual_floor:.2e}" in rows[-1]


def test_float64_floor_is_far_below_tol() -> None:
    m = _matrix()
    res = lanczos(dense_op(m), k=5, which="SA", tol=TOL, seed=0)
    assert res.residual_floor <= 1e-12
    assert bool(res.converged.all()) and not bool(res.floor_only().any())
    assert (_true_residuals(m, res) <= TOL * res.eigenvalues.abs().numpy()).all()


def test_power_iteration_one_carries_the_rule_and_still_unpacks() -> None:
    m = _matrix()
    out = power_iteration_one(dense_op(m, dtype=torch.float32), tol=TOL, max_iter=500, seed=0)
    lam, vec, residual, iterations, converged = out  # five fields, as DESIGN promises
    assert out.tol == TOL
    level = rounding_level(torch.float32, torch.float32)
    assert 0.99 * NORM * level <= out.residual_floor <= 1.001 * NORM * level
    assert converged == (residual <= max(TOL * abs(lam), out.residual_floor))
    v = vec.to(torch.float64).numpy()
    np.testing.assert_allclose(residual, np.linalg.norm(m @ v - lam * v), rtol=0.05)
    assert iterations <= 500
