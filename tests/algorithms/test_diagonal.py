"""Diagonal estimators: unbiasedness and the variance reduction of Diag++."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import diagonal
from tests.algorithms.spectra import CountingOp, dense_matrix, dense_op, spectrum


@pytest.mark.parametrize("method", ["hutchinson", "diag++"])
def test_unbiased_over_seeds(method: str) -> None:
    m = dense_matrix(spectrum("indefinite", 30, seed=4), seed=4)
    runs = torch.stack(
        [
            diagonal(
                dense_op(m), num_matvecs=9, method=method, distribution="gaussian", seed=s
            ).estimate  # type: ignore[arg-type]
            for s in range(300)
        ]
    ).numpy()
    mean, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(runs.shape[0])
    z = (mean - np.diag(m)) / se
    assert np.abs(z).max() < 4.5, np.abs(z).max()  # 30 entries: the max |z| of 30 normals


def test_stderr_is_honest() -> None:
    m = dense_matrix(spectrum("indefinite", 20, seed=5), seed=5)
    runs = [diagonal(dense_op(m), num_matvecs=50, method="hutchinson", seed=s) for s in range(200)]
    spread = torch.stack([r.estimate for r in runs]).std(0)
    mean_stderr = torch.stack([r.stderr for r in runs]).mean(0)
    ratio = (mean_stderr / spread).numpy()
    assert 0.75 < np.median(ratio) < 1.25


def test_diag_plus_plus_beats_hutchinson_on_power_law() -> None:
    m = dense_matrix(1.0 / np.arange(1, 201) ** 2.0, seed=6)
    truth = np.diag(m)
    err = {}
    for method in ("hutchinson", "diag++"):
        errs = [
            diagonal(dense_op(m), num_matvecs=60, method=method, seed=s).estimate.numpy() - truth
            for s in range(10)
        ]  # type: ignore[arg-type]
        err[method] = np.sqrt(np.mean(np.square(errs)))
    assert err["diag++"] < err["hutchinson"] / 5, err


def test_blocks_and_exact_small_case() -> None:
    m = torch.as_tensor(dense_matrix(spectrum("separated", 12)))
    op = CountingOp(m)
    res = diagonal(op, num_matvecs=45, seed=0)  # sketch of 15 >= n: exact
    torch.testing.assert_close(res.estimate, torch.diagonal(m), rtol=1e-10, atol=1e-12)
    assert res.num_matvecs == op.num_matvecs == 15 + 12
    op2 = CountingOp(m)
    diagonal(op2, num_matvecs=40, method="hutchinson", block_size=16, seed=0)
    assert op2.passes == 3 and op2.num_matvecs == 40


def test_errors() -> None:
    op = dense_op(dense_matrix(spectrum("separated", 12)))
    with pytest.raises(ValueError, match="method must be"):
        diagonal(op, method="xdiag")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_matvecs must be an int >= 3"):
        diagonal(op, num_matvecs=2)
