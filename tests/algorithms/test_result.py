"""Result types: frozen, printable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hessian_eigenthings.algorithms import EigenResult, lanczos
from tests.algorithms.spectra import diag_op


def test_eigen_result_summary_and_frozen() -> None:
    res = lanczos(diag_op(np.linspace(3.0, 0.0, 40)), k=2, tol=1e-8, seed=0)
    text = str(res)
    assert "2/2 converged" in text and "3.000000e+00" in text
    assert isinstance(res, EigenResult)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.iterations = 3  # type: ignore[misc]


def test_summary_shows_the_relative_residual_that_tol_bounds() -> None:
    import torch

    from hessian_eigenthings.algorithms import TraceResult

    res = EigenResult(
        eigenvalues=torch.tensor([2.0, -0.5], dtype=torch.float64),
        eigenvectors=torch.eye(2, 3),
        residuals=torch.tensor([2e-4, 1e-5], dtype=torch.float64),
        iterations=7,
        converged=torch.tensor([True, True]),
    )
    rows = res.summary().splitlines()
    assert "residual/|λ|" in rows[1]
    assert "1.00e-04" in rows[2] and "2.00e-04" in rows[2]  # relative, then absolute
    assert "2.00e-05" in rows[3] and "1.00e-05" in rows[3]

    tr = TraceResult(estimate=1.5, stderr=0.25, samples=torch.arange(500, dtype=torch.float64))
    text = repr(tr)
    assert text == "TraceResult(estimate=1.5, stderr=0.25, samples=<500 values>)"
