"""refine_eigenpairs and lanczos_tf32_refine against numpy.linalg.eigh: an operator whose
"tf32" products carry a relative error of 1e-3 (a symmetric perturbation), as TF32 products
of an fp32 model do, is refined by its exact products to the exact eigenpairs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import ConvergenceWarning, lanczos
from hessian_eigenthings.algorithms.refine import lanczos_tf32_refine, refine_eigenpairs
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix, spectrum


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to 11 significant bits, as TF32 matrix products round their inputs."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.tensor(11))), exponent - 11)


class TwoPrecisions(LambdaOperator):
    """``A v`` in "fp32"; in "tf32", ``A`` and ``v`` rounded to TF32's 11 bits first (a
    product ~1e-3 off that is not a fixed linear map, as on a GPU); counts products per mode."""

    def __init__(self, m: np.ndarray) -> None:
        self.A = torch.as_tensor(m)
        self.A32 = _tf32(self.A)
        self.precision = "fp32"
        self.counts = {"fp32": 0, "tf32": 0}
        super().__init__(self._vector, m.shape[0], dtype=torch.float64, matmat_fn=self._rows)

    def _vector(self, v: torch.Tensor) -> torch.Tensor:
        return self._rows(v.unsqueeze(0))[0]

    def _rows(self, V: torch.Tensor) -> torch.Tensor:
        self.counts[self.precision] += V.shape[0]
        if self.precision == "tf32":
            return _tf32(V) @ self.A32.T
        return V @ self.A.T


def _truth(m: np.ndarray, which: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    w, v = np.linalg.eigh(m)
    order = {"LM": np.argsort(-np.abs(w)), "LA": np.argsort(-w), "SA": np.argsort(w)}[which][:k]
    return w[order], v[:, order]


@pytest.mark.parametrize("kind", ["separated", "indefinite", "powerlaw"])
@pytest.mark.parametrize("which", ["LM", "LA"])
def test_tf32_then_refine_gives_the_exact_pairs(kind: str, which: str) -> None:
    m = dense_matrix(spectrum(kind, 120, seed=1), seed=2)
    op = TwoPrecisions(m)
    res = lanczos_tf32_refine(op, k=4, which=which, tol=1e-9, seed=0, refine_max_iter=2000)
    w, v = _truth(m, which, 4)
    assert bool(res.converged.all())
    np.testing.assert_allclose(res.eigenvalues.numpy(), w, rtol=1e-8)
    # true residuals of the exact operator, as reported
    Y = res.eigenvectors.numpy()
    true_res = np.linalg.norm(Y @ m - res.eigenvalues.numpy()[:, None] * Y, axis=1)
    np.testing.assert_allclose(res.residuals.numpy(), true_res, rtol=1e-6, atol=1e-13)
    assert np.all(np.abs(np.sum(Y * v.T, axis=1)) > 1 - 1e-8)
    # both phases ran, the product count is their sum, and the switch is back
    assert op.counts["tf32"] > 0 and op.counts["fp32"] > 0
    assert res.iterations == op.counts["tf32"] + op.counts["fp32"]
    assert op.precision == "fp32"


def test_the_tf32_phase_alone_stalls_at_its_error() -> None:
    """Why the second phase exists: in "tf32" the Krylov recurrence's residual estimates fall
    (the run stops), but the true residuals stay at the products' error, ~1e-3, and the Ritz
    values off."""
    m = dense_matrix(spectrum("separated", 120, seed=1), seed=2)
    op = TwoPrecisions(m)
    op.precision = "tf32"
    with pytest.warns(ConvergenceWarning):
        rough = lanczos(op, k=4, which="LA", tol=1e-9, seed=0, max_iter=400, residuals="exact")
    assert not bool(rough.converged.any()) and rough.iterations < 400
    assert float((rough.residuals / rough.eigenvalues.abs()).min()) > 1e-4
    # the default's residuals, from the products made (NOTE [recorded residuals]), show the
    # products' error too, without recomputing
    with pytest.warns(ConvergenceWarning):
        recorded = lanczos(op, k=4, which="LA", tol=1e-9, seed=0, max_iter=400)
    assert not bool(recorded.converged.any())
    assert float((recorded.residuals / recorded.eigenvalues.abs()).min()) > 3e-5
    w, _ = _truth(m, "LA", 4)
    err = np.max(np.abs(rough.eigenvalues.numpy() - w) / np.abs(w))
    assert err > 1e-7
    op.precision = "fp32"
    fine = refine_eigenpairs(op, rough, which="LA", tol=1e-9, max_iter=2000)
    np.testing.assert_allclose(fine.eigenvalues.numpy(), w, rtol=1e-9)


def test_refine_from_a_perturbed_basis_and_budget() -> None:
    m = dense_matrix(spectrum("clustered", 80, seed=3), seed=4)
    w, v = _truth(m, "LA", 3)
    rng = np.random.default_rng(0)
    start = torch.as_tensor((v + 1e-2 * rng.standard_normal(v.shape)).T)
    op = TwoPrecisions(m)
    res = refine_eigenpairs(op, start, which="LA", tol=1e-10)
    np.testing.assert_allclose(res.eigenvalues.numpy(), w, rtol=1e-9)
    with pytest.warns(ConvergenceWarning, match="refine_eigenpairs"):
        short = refine_eigenpairs(TwoPrecisions(m), start, which="LA", tol=1e-14, max_iter=4)
    assert short.iterations <= 4


def test_bad_arguments() -> None:
    m = dense_matrix(spectrum("separated", 30, seed=1), seed=2)
    op = TwoPrecisions(m)
    with pytest.raises(ValueError, match="start"):
        refine_eigenpairs(op, torch.ones(2, 29, dtype=torch.float64))
    with pytest.raises(ValueError, match="rank"):
        refine_eigenpairs(op, torch.ones(2, 30, dtype=torch.float64))
    with pytest.raises(ValueError, match="which"):
        refine_eigenpairs(op, torch.eye(30, dtype=torch.float64)[:2], which="XX")  # type: ignore[arg-type]
    plain = LambdaOperator(lambda v: v, 30, dtype=torch.float64)
    with pytest.raises(TypeError, match="precision"):
        lanczos_tf32_refine(plain, k=2)


def test_most_products_run_in_tf32() -> None:
    """NOTE [tf32 then refine]: the TF32 phase runs on its residual estimates to the user's tol,
    so the fp32 phase is one Rayleigh-Ritz and little more (k = 5: 5 products at tol 1e-3)."""
    m = dense_matrix(spectrum("separated", 400, seed=1), seed=2)
    cold = TwoPrecisions(m)
    lanczos(cold, k=5, which="LA", tol=1e-3, seed=0)
    op = TwoPrecisions(m)
    res = lanczos_tf32_refine(op, k=5, which="LA", tol=1e-3, seed=0)
    assert bool(res.converged.all())
    assert op.counts["fp32"] <= 10 < cold.counts["fp32"] // 5
    assert op.counts["tf32"] <= cold.counts["fp32"]
