"""The facade computes what the 1.0 core computes, at the same cost.

Costs are compared with counters that do not depend on machine noise: the
operator's ``num_matvecs`` and, for Hessians, forward passes over the data.
"""

from __future__ import annotations

import deprecation
import numpy as np
import pytest
import torch

from hessian_eigenthings import algorithms, compat
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator, LambdaOperator
from hessian_eigenthings.operators.engines import auto as engines_auto
from tests.compat.cases import mlp_problem, symmetric_matrix


def _counting(A: torch.Tensor) -> LambdaOperator:
    return LambdaOperator(lambda v: A @ v, A.shape[0], dtype=A.dtype)


def test_lanczos_same_start_same_result_same_products() -> None:
    A = symmetric_matrix(50, dtype=torch.float64)
    v0 = torch.linspace(1.0, 2.0, 50, dtype=torch.float64)
    old_op, new_op = _counting(A), _counting(A)
    with pytest.warns(deprecation.DeprecatedWarning):
        vals, vecs = compat.lanczos(old_op, 3, "LM", 20, 1e-8, 12, v0)
    # the documented translation: ncv as given, max_iter = ncv + max_steps * (ncv - k), ARPACK's
    # convergence test (NOTE [0.x lanczos convergence])
    res = algorithms.lanczos(
        new_op, k=3, which="LM", tol=1e-8, ncv=12, max_iter=12 + 20 * 9, v0=v0, residuals="estimate"
    )
    order = torch.argsort(res.eigenvalues)
    np.testing.assert_array_equal(vals, res.eigenvalues[order].numpy())
    np.testing.assert_array_equal(vecs, res.eigenvectors[order].numpy())
    assert old_op.num_matvecs == new_op.num_matvecs


@pytest.mark.parametrize("k", [1, 3])
def test_deflated_power_iteration_budget_bound_costs_the_same(k: int) -> None:
    A = symmetric_matrix(40, dtype=torch.float64)
    old_op, new_op = _counting(A), _counting(A)
    with pytest.warns(deprecation.DeprecatedWarning):
        _quiet(
            lambda: compat.deflated_power_iteration(old_op, k, 15, 0.0, use_gpu=False)
        )  # tol 0: every step runs
    _quiet(lambda: algorithms.deflated_power_iteration(new_op, k=k, max_iter=15, tol=0.0, seed=0))
    assert old_op.num_matvecs == new_op.num_matvecs


def test_power_iteration_budget_bound_costs_the_same() -> None:
    A = symmetric_matrix(40, dtype=torch.float64)
    old_op, new_op = _counting(A), _counting(A)
    init = torch.ones(40, dtype=torch.float64)
    with pytest.warns(deprecation.DeprecatedWarning):
        val, vec = _quiet(
            lambda: compat.power_iteration(old_op, 15, 0.0, use_gpu=False, init_vec=init)
        )
    ref = _quiet(lambda: algorithms.power_iteration_one(new_op, max_iter=15, tol=0.0, init=init))
    assert old_op.num_matvecs == new_op.num_matvecs
    assert val == float(ref.eigenvalue)
    torch.testing.assert_close(vec, ref.eigenvector, rtol=0, atol=0)


def test_converged_results_agree_with_the_core() -> None:
    # facade threshold 1e-10 is a 1.0 tol of 1e-5 (NOTE [0.x power iteration threshold])
    A = symmetric_matrix(40, dtype=torch.float64)
    with pytest.warns(deprecation.DeprecatedWarning):
        vals, vecs = compat.deflated_power_iteration(_counting(A), 2, 500, 1e-10, use_gpu=False)
    res = _quiet(
        lambda: algorithms.deflated_power_iteration(
            _counting(A), k=2, max_iter=500, tol=1e-5, seed=3
        )
    )
    np.testing.assert_allclose(vals, np.sort(res.eigenvalues.numpy())[::-1], rtol=1e-6)
    cos = np.abs(
        np.sum(vecs * res.eigenvectors.numpy()[np.argsort(-res.eigenvalues.numpy())], axis=1)
    )
    assert np.all(cos > 1 - 1e-4)


@pytest.mark.parametrize("mode", ["power_iter", "lanczos"])
def test_compute_hessian_eigenthings_costs_what_the_core_costs(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # both runs on the engine `auto` keeps for runs too short to repay a trace: whether a trial
    # runs depends on this machine's product time, and a trial's trace is a data pass of its own
    monkeypatch.setattr(engines_auto, "TRACE_PRIOR_S_PER_MODULE", 60.0)
    model, criterion, data = mlp_problem()
    calls = {"facade": 0}

    def counted(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls["facade"] += 1
        return criterion(output, target)

    n = sum(p.numel() for p in model.parameters())
    init = torch.ones(n)
    kwargs = (
        {"power_iter_steps": 10, "power_iter_err_threshold": 0.0}
        if mode == "power_iter"
        else {"init_vec": init, "num_lanczos_vectors": 10, "max_steps": 5, "tol": 1e-5}
    )
    with pytest.warns(deprecation.DeprecatedWarning):
        vals, _ = _quiet(
            lambda: compat.compute_hessian_eigenthings(
                model, data, counted, 2, mode=mode, use_gpu=False, **kwargs
            )
        )

    op = HessianOperator(model, data, supervised_loss(criterion))
    if mode == "power_iter":
        _quiet(lambda: algorithms.deflated_power_iteration(op, k=2, max_iter=10, tol=0.0, seed=0))
    else:
        res = algorithms.lanczos(op, k=2, ncv=10, max_iter=10 + 5 * 8, tol=1e-5, v0=init)
        np.testing.assert_allclose(vals, np.sort(res.eigenvalues.numpy()), rtol=1e-5)
    assert calls["facade"] == op.num_forwards  # forward passes: the facade pays no extra data pass


def _quiet(fn):  # type: ignore[no-untyped-def]
    """Run a budget-bound solve: not converging is the point, so its ConvergenceWarning is expected."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=algorithms.ConvergenceWarning)
        return fn()
