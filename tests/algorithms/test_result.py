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
