"""solve / inverse: against numpy's dense solves in float64, blocks against columns one by one,
preconditioning, honest convergence reporting and input errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.algorithms import ConvergenceWarning, InverseOperator, SolveResult
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator, HessianOperator, LambdaOperator
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import classification_data, mlp
from tests.operators.curvature_oracles import dense_ggn

N = 30


def _sym(eigenvalues: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((len(eigenvalues), len(eigenvalues))))
    return (q * eigenvalues) @ q.T


def _spd(n: int = N, cond: float = 1e3, seed: int = 0) -> np.ndarray:
    return _sym(np.logspace(0, np.log10(cond), n) / cond, seed)


def _indefinite(n: int = N, seed: int = 1) -> np.ndarray:
    ev = np.linspace(-2.0, 3.0, n)
    ev[np.abs(ev) < 0.3] = 0.4  # keep it well away from singular
    return _sym(ev, seed)


class Counting(LambdaOperator):
    """A dense operator that counts its product calls (a block of rows or one vector: one call)."""

    def __init__(self, A: np.ndarray, dtype: torch.dtype = torch.float64) -> None:
        self.A = torch.as_tensor(A, dtype=dtype)
        self.calls = 0
        super().__init__(self._vector, A.shape[0], dtype=dtype, matmat_fn=self._rows)

    def _vector(self, v: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.A @ v

    def _rows(self, V: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return V @ self.A.T


def _rhs(k: int | None, n: int = N, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) if k is None else torch.randn(n, k, generator=g, dtype=torch.float64)


def _reference(A: np.ndarray, b: torch.Tensor, damping: float = 0.0) -> torch.Tensor:
    return torch.as_tensor(np.linalg.solve(A + damping * np.eye(A.shape[0]), b.numpy()))


def _assert_forward_error(x: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    """``||x - x*|| <= bound · ||x*||`` per column: a relative residual ``tol`` allows a relative
    error up to ``cond · tol``."""
    err = (x - ref).reshape(ref.shape[0], -1).norm(dim=0) / ref.reshape(ref.shape[0], -1).norm(dim=0)
    assert float(err.max()) <= bound, float(err.max())


def _true_residuals(A: np.ndarray, x: torch.Tensor, b: torch.Tensor, damping: float = 0.0) -> np.ndarray:
    X, B = x.numpy().reshape(A.shape[0], -1), b.numpy().reshape(A.shape[0], -1)
    R = B - (A + damping * np.eye(A.shape[0])) @ X
    return np.linalg.norm(R, axis=0) / np.linalg.norm(B, axis=0)


@pytest.mark.parametrize("k", [None, 4])
@pytest.mark.parametrize("damping", [0.0, 0.05])
def test_cg_matches_dense_solve(k: int | None, damping: float) -> None:
    A = _spd()
    b = _rhs(k)
    res = he.solve(Counting(A), b, damping=damping, tol=1e-10, progress=False)
    assert isinstance(res, SolveResult)
    assert res.x.shape == b.shape and res.x.dtype == torch.float64
    torch.testing.assert_close(res.x, _reference(A, b, damping), rtol=1e-7, atol=1e-8)
    assert bool(res.converged.all()) and res.converged.shape == (1 if k is None else k,)
    # the reported residuals are the true ones
    np.testing.assert_allclose(res.residual_norms.numpy(), _true_residuals(A, res.x, b, damping), rtol=1e-6, atol=1e-14)
    assert float(res.residual_norms.max()) <= 1e-10
    assert not bool(res.negative_curvature.any())


@pytest.mark.parametrize("k", [None, 3])
def test_minres_solves_indefinite_systems(k: int | None) -> None:
    A = _indefinite()
    b = _rhs(k)
    res = he.solve(Counting(A), b, method="minres", tol=1e-10, progress=False)
    torch.testing.assert_close(res.x, _reference(A, b), rtol=1e-8, atol=1e-9)
    assert bool(res.converged.all())
    np.testing.assert_allclose(res.residual_norms.numpy(), _true_residuals(A, res.x, b), rtol=1e-6, atol=1e-14)


def test_minres_with_negative_damping_is_shift_and_invert() -> None:
    A = _spd(cond=10.0)
    b = _rhs(2)
    shift = -0.35  # inside the spectrum [0.1, 1]: A - 0.35 I is indefinite
    res = he.solve(Counting(A), b, damping=shift, method="minres", tol=1e-10, progress=False)
    torch.testing.assert_close(res.x, _reference(A, b, shift), rtol=1e-7, atol=1e-8)


def test_neumann_on_a_well_conditioned_system() -> None:
    A = _sym(np.linspace(1.0, 2.0, N), 5)
    b = _rhs(2)
    res = he.solve(Counting(A), b, method="neumann", scale=1 / 2.0, tol=1e-9, progress=False)
    torch.testing.assert_close(res.x, _reference(A, b), rtol=1e-8, atol=1e-8)
    assert bool(res.converged.all())
    # the residual shrinks by (1 - s λ_min) = 1/2 per term: about log2(1e9) = 30 terms
    assert 25 <= res.iterations <= 35


def test_neumann_needs_a_scale_and_reports_divergence() -> None:
    A = _sym(np.linspace(1.0, 2.0, N), 5)
    with pytest.raises(ValueError, match="scale"):
        he.solve(Counting(A), _rhs(None), method="neumann")
    with pytest.warns(ConvergenceWarning, match="Neumann series diverges"):
        res = he.solve(Counting(A), _rhs(None), method="neumann", scale=1.5, progress=False)  # > 2/λ_max
    assert not bool(res.converged.any())
    assert res.iterations < 40  # stopped as soon as the residual grew 1000-fold


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_block_equals_columns_one_by_one(method: str) -> None:
    # a diagonal operator: a block product rounds exactly like single products, so every
    # column of the block must follow its single-column run bit for bit
    A = np.diag(np.logspace(-2, 0, N))
    b = _rhs(5)
    # column j lives on the first 6(j+1) coordinates: CG needs at most 6(j+1) iterations
    # for it (the distinct eigenvalues it sees), so the columns stop at different
    # iterations whatever the rounding of the torch version
    for j in range(5):
        b[6 * (j + 1) :, j] = 0.0
    op = Counting(A)
    block = he.solve(op, b, damping=0.01, method=method, progress=False)
    singles = [he.solve(Counting(A), b[:, j], damping=0.01, method=method, progress=False) for j in range(5)]
    assert torch.equal(block.x, torch.stack([s.x for s in singles], dim=1))
    # the final true residual is one block product against k vector products: rounding apart
    torch.testing.assert_close(block.residual_norms, torch.cat([s.residual_norms for s in singles]), rtol=1e-9, atol=0)
    assert len({s.iterations for s in singles}) > 1  # the columns stop at different iterations
    # converged columns leave the block: the products are those of the columns one by one
    assert block.num_matvecs == sum(s.num_matvecs for s in singles)
    assert block.iterations == max(s.iterations for s in singles)
    # one product call (a block, or the last column alone) per iteration, plus one for the
    # true residuals
    assert op.calls == block.iterations + 1
    assert op.num_matvecs == block.num_matvecs
    # a dense operator rounds blocks differently from vectors (and CG amplifies rounding):
    # the two agree to the accuracy asked for
    A = _spd(cond=1e2)
    block = he.solve(Counting(A), b, method=method, tol=1e-12, progress=False)
    singles = [he.solve(Counting(A), b[:, j], method=method, tol=1e-12, progress=False) for j in range(5)]
    torch.testing.assert_close(block.x, torch.stack([s.x for s in singles], dim=1), rtol=1e-9, atol=1e-10)


def test_columns_of_a_block_converge_at_their_own_pace() -> None:
    A = _spd(cond=1e3)
    _, eigvecs = np.linalg.eigh(A)
    # column 0 is an eigenvector (one iteration), column 1 a generic vector
    b = torch.stack([torch.as_tensor(eigvecs[:, 3]), _rhs(None)], dim=1)
    res = he.solve(Counting(A), b, tol=1e-10, progress=False)
    assert bool(res.converged.all())
    torch.testing.assert_close(res.x, _reference(A, b), rtol=1e-7, atol=1e-8)
    assert res.num_matvecs == 1 + res.iterations + 2  # column 0: one product; then the final check


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_jacobi_preconditioner_cuts_iterations(method: str) -> None:
    rng = np.random.default_rng(7)
    d = np.logspace(-3, 3, N)
    A = np.diag(d) + 1e-4 * _spd(cond=10.0) + 1e-4 * np.diag(rng.random(N))
    b = _rhs(2)
    diag = torch.as_tensor(np.diag(A).copy())
    plain = he.solve(Counting(A), b, method=method, max_iter=5000, progress=False)
    jacobi = he.solve(Counting(A), b, method=method, preconditioner=lambda R: R / diag[:, None], progress=False)
    assert bool(plain.converged.all()) and bool(jacobi.converged.all())
    assert plain.iterations >= 60
    assert jacobi.iterations <= 10
    torch.testing.assert_close(jacobi.x, _reference(A, b), rtol=1e-5, atol=1e-9)
    # the same preconditioner as an operator gives the same iterates
    as_op = LambdaOperator(lambda v: v / diag, N, dtype=torch.float64)
    again = he.solve(Counting(A), b, method=method, preconditioner=as_op, progress=False)
    torch.testing.assert_close(again.x, jacobi.x, rtol=1e-12, atol=1e-14)
    assert again.iterations == jacobi.iterations


def test_callable_preconditioner_sees_residuals_shaped_like_b() -> None:
    A = _spd(cond=10.0)
    shapes: list[tuple[int, ...]] = []

    def ident(r: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(r.shape))
        return r

    he.solve(Counting(A), _rhs(None), preconditioner=ident, progress=False)
    assert set(shapes) == {(N,)}
    shapes.clear()
    he.solve(Counting(A), _rhs(3), preconditioner=ident, progress=False)
    assert shapes[0] == (N, 3) and all(s[0] == N and s[1] <= 3 for s in shapes)


def test_nonconvergence_warns_and_reports_true_residuals() -> None:
    A = _spd(cond=1e4)
    b = _rhs(2)
    with pytest.warns(ConvergenceWarning, match="max_iter=3 ran out") as rec:
        res = he.solve(Counting(A), b, max_iter=3, progress=False)
    assert rec[0].filename == __file__
    assert not bool(res.converged.any()) and res.iterations == 3
    np.testing.assert_allclose(res.residual_norms.numpy(), _true_residuals(A, res.x, b), rtol=1e-8)
    assert float(res.residual_norms.min()) > 1e-6
    # "estimate" reports the recursive residual (equal here up to rounding) without the extra product
    with pytest.warns(ConvergenceWarning):
        est = he.solve(Counting(A), b, max_iter=3, residuals="estimate", progress=False)
    assert est.num_matvecs == res.num_matvecs - 2
    np.testing.assert_allclose(est.residual_norms.numpy(), res.residual_norms.numpy(), rtol=1e-6)


def test_cg_stops_on_negative_curvature_and_says_so() -> None:
    A = _indefinite()
    b = _rhs(2)
    with pytest.warns(ConvergenceWarning, match="not positive definite.*minres"):
        res = he.solve(Counting(A), b, progress=False)
    assert bool(res.negative_curvature.all()) and not bool(res.converged.any())
    assert bool(torch.isfinite(res.x).all())
    # enough damping makes it positive definite: CG then converges
    res = he.solve(Counting(A), b, damping=2.5, progress=False)
    assert bool(res.converged.all()) and not bool(res.negative_curvature.any())
    torch.testing.assert_close(res.x, _reference(A, b, 2.5), rtol=1e-5, atol=1e-7)


def test_indefinite_preconditioner_is_reported() -> None:
    A = _spd(cond=10.0)
    with pytest.warns(ConvergenceWarning, match="preconditioner is not positive definite"):
        res = he.solve(Counting(A), _rhs(None), preconditioner=lambda r: -r, progress=False)
    assert not bool(res.converged.any())


def test_x0_and_zero_right_hand_sides() -> None:
    A = _spd(cond=10.0)
    b = _rhs(2)
    exact = _reference(A, b)
    res = he.solve(Counting(A), b, x0=exact.clone(), tol=1e-8, progress=False)
    assert res.iterations == 0 and bool(res.converged.all())
    near = he.solve(Counting(A), b, x0=exact + 1e-3, tol=1e-10, progress=False)
    assert bool(near.converged.all())
    _assert_forward_error(near.x, exact, 10 * 1e-10)  # cond(A) = 10
    b0 = b.clone()
    b0[:, 1] = 0
    res = he.solve(Counting(A), b0, progress=False)
    assert torch.equal(res.x[:, 1], torch.zeros(N, dtype=torch.float64))
    assert bool(res.converged.all()) and float(res.residual_norms[1]) == 0.0


def test_float32_operator_gives_float32_solution() -> None:
    A = _spd(cond=10.0)
    b = _rhs(2).float()
    res = he.solve(Counting(A, torch.float32), b, tol=1e-5, progress=False)
    assert res.x.dtype == torch.float32 and bool(res.converged.all())
    _assert_forward_error(res.x.double(), _reference(A, b.double()), 10 * 1e-5)  # cond(A) = 10


def test_bad_input_is_refused_with_the_fix() -> None:
    op = Counting(_spd())
    b = _rhs(None)
    with pytest.raises(ValueError, match=r"shape \(30,\) or \(30, k\)"):
        he.solve(op, torch.zeros(N + 1, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"pass b.to\(torch.float64\)"):
        he.solve(op, b.float())
    with pytest.raises(TypeError, match="CurvatureOperator"):
        he.solve(torch.eye(N), b)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="method must be one of"):
        he.solve(op, b, method="gmres")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tol must be > 0"):
        he.solve(op, b, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        he.solve(op, b, max_iter=0)
    with pytest.raises(ValueError, match="damping must be finite"):
        he.solve(op, b, damping=float("nan"))
    with pytest.raises(ValueError, match="only"):
        he.solve(op, b, scale=0.5)
    with pytest.raises(ValueError, match="scale must be > 0"):
        he.solve(op, b, method="neumann", scale=-1.0)
    with pytest.raises(TypeError, match="preconditioner must be"):
        he.solve(op, b, preconditioner="jacobi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preconditioner has size"):
        he.solve(op, b, preconditioner=LambdaOperator(lambda v: v, N + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="shaped like its input"):
        he.solve(op, b, preconditioner=lambda r: r[:-1], progress=False)
    with pytest.raises(ValueError, match="x0 must have the shape of b"):
        he.solve(op, b, x0=torch.zeros(N, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="residuals must be"):
        he.solve(op, b, residuals="true")  # type: ignore[arg-type]


def test_non_finite_products_raise() -> None:
    op = LambdaOperator(lambda v: v * float("nan"), N, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        he.solve(op, _rhs(None), progress=False)


def test_inverse_is_an_operator_of_solves() -> None:
    A = _spd(cond=1e2)
    inv = he.inverse(Counting(A), 0.1, tol=1e-12)
    assert isinstance(inv, InverseOperator) and inv.size == N
    expected = torch.as_tensor(np.linalg.inv(A + 0.1 * np.eye(N)))
    torch.testing.assert_close(inv.to_dense(), expected, rtol=1e-8, atol=1e-10)
    v = _rhs(None)
    torch.testing.assert_close(inv @ v, expected @ v, rtol=1e-8, atol=1e-10)
    assert inv.last_result is not None and bool(inv.last_result.converged.all())
    # an algorithm on the inverse: its largest eigenvalue is 1 / (λ_min(A) + damping)
    top = he.lanczos(inv, k=1, which="LA", seed=0, tol=1e-8)
    lam_min = float(np.linalg.eigvalsh(A)[0])
    assert float(top.eigenvalues[0]) == pytest.approx(1 / (lam_min + 0.1), rel=1e-6)


def test_inverse_checks_its_arguments_up_front() -> None:
    op = Counting(_spd())
    with pytest.raises(TypeError, match="x0"):
        he.inverse(op, 0.1, x0=torch.zeros(N, dtype=torch.float64))
    with pytest.raises(TypeError, match="unexpected"):
        he.inverse(op, 0.1, tolerance=1e-3)
    with pytest.raises(ValueError, match="scale"):
        he.inverse(op, 0.1, method="neumann")
    with pytest.raises(ValueError, match="method"):
        he.inverse(op, 0.1, method="lsmr")  # type: ignore[arg-type]


def test_damped_ggn_and_hessian_of_an_mlp_against_dense() -> None:
    model = mlp()
    data = classification_data(n=10)
    params = select_parameters(model)
    ce = nn.CrossEntropyLoss()
    ggn = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(ce))
    G = dense_ggn(model, data, supervised_forward, supervised_loss_of_output(ce), params).numpy()
    b = _rhs(3, n=ggn.size)
    res = he.solve(ggn, b, damping=1e-2, tol=1e-10, progress=False)
    assert bool(res.converged.all())
    torch.testing.assert_close(res.x, _reference(G, b, 1e-2), rtol=1e-7, atol=1e-8)
    hess = HessianOperator(model, data, supervised_loss(ce))
    H = dense_hessian(model, data, supervised_loss(ce), params).numpy()
    res = he.solve(hess, b[:, 0], damping=0.05, method="minres", tol=1e-10, progress=False)
    torch.testing.assert_close(res.x, _reference(H, b[:, 0], 0.05), rtol=1e-6, atol=1e-7)
    inv = he.inverse(ggn, 1e-2, tol=1e-10)
    torch.testing.assert_close(inv @ b, _reference(G, b, 1e-2), rtol=1e-7, atol=1e-8)
