"""Operator algebra: every combination equals its dense matrix, blocks stay blocks, products are
counted in the parts, and bad combinations are refused with the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import (
    CurvatureOperator,
    GGNOperator,
    HessianOperator,
    LambdaOperator,
    LinearCombinationOperator,
    RectangularSubmatrix,
    SubmatrixOperator,
)
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import classification_data, mlp
from tests.operators.curvature_oracles import dense_ggn

N = 9


def _dense(seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(N, N, generator=g, dtype=torch.float64)
    return (M + M.T).to(dtype)


class Dense(LambdaOperator):
    """A dense symmetric matrix as an operator, counting calls of its block function."""

    def __init__(self, M: torch.Tensor) -> None:
        self.M = M
        self.block_calls = 0
        self.expected: list[int] = []
        super().__init__(lambda v: M @ v, M.shape[0], dtype=M.dtype, matmat_fn=self._rows)

    def _rows(self, V: torch.Tensor) -> torch.Tensor:
        self.block_calls += 1
        return V @ self.M

    def expect_products(self, n: int) -> None:
        self.expected.append(n)


@pytest.fixture
def pair() -> tuple[Dense, Dense, torch.Tensor, torch.Tensor]:
    A, B = _dense(0), _dense(1)
    return Dense(A), Dense(B), A, B


def _cases(a: Dense, b: Dense, A: torch.Tensor, B: torch.Tensor) -> list[tuple[str, CurvatureOperator, torch.Tensor]]:
    return [
        ("A + B", a + b, A + B),
        ("A - B", a - b, A - B),
        ("c * A", 2.5 * a, 2.5 * A),
        ("A * c", a * -3, -3 * A),
        ("A / c", a / 4, A / 4),
        ("-A", -a, -A),
        ("tensor c * A", torch.tensor(0.5, dtype=torch.float64) * a, 0.5 * A),
        ("nested", 2 * (a - b) / 3 + -a, 2 * (A - B) / 3 - A),
    ]


def test_every_combination_equals_its_dense_matrix(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, b, A, B = pair
    g = torch.Generator().manual_seed(5)
    v = torch.randn(N, generator=g, dtype=torch.float64)
    V = torch.randn(N, 4, generator=g, dtype=torch.float64)
    for name, op, dense in _cases(a, b, A, B):
        assert isinstance(op, LinearCombinationOperator), name
        assert op.shape == (N, N) and op.dtype == torch.float64, name
        torch.testing.assert_close(op.to_dense(), dense, rtol=1e-13, atol=1e-13, msg=name)
        torch.testing.assert_close(op @ v, dense @ v, rtol=1e-13, atol=1e-13, msg=name)
        torch.testing.assert_close(op @ V, dense @ V, rtol=1e-13, atol=1e-13, msg=name)
        sp = op.to_scipy()
        np.testing.assert_allclose(sp @ v.numpy(), (dense @ v).numpy(), rtol=1e-12, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(sp.matmat(V.numpy()), (dense @ V).numpy(), rtol=1e-12, atol=1e-12, err_msg=name)


def test_a_block_is_one_block_product_of_each_part(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, b, _, _ = pair
    s = a + 2 * b
    V = torch.randn(N, 6, dtype=torch.float64)
    s @ V
    assert (a.block_calls, b.block_calls) == (1, 1)
    # every part counts its own products, and so does the sum
    assert (a.num_matvecs, b.num_matvecs, s.num_matvecs) == (6, 6, 6)
    s @ V[:, 0].contiguous()
    assert (a.num_matvecs, b.num_matvecs, s.num_matvecs) == (7, 7, 7)


def test_hooks_are_forwarded_to_the_parts(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, b, _, _ = pair
    s = a - b
    s.expect_products(40)
    assert a.expected == [40] and b.expected == [40]
    half = LambdaOperator(lambda v: v, N, dtype=torch.float16)
    causes = (half + half).inconsistency_causes()
    assert len(causes) == 1 and "float16" in causes[0]  # listed once, not once per part
    assert a.submatrix([1, 2]).inconsistency_causes() == a.inconsistency_causes()


def test_algorithms_run_on_combinations(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, b, A, B = pair
    res = he.lanczos(a - b, k=2, which="LA", seed=0, tol=1e-10)
    expected = torch.linalg.eigvalsh(A - B).flip(0)[:2]
    torch.testing.assert_close(res.eigenvalues, expected, rtol=1e-8, atol=1e-10)


def test_left_multiplication(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, _, A, _ = pair
    X = torch.randn(3, N, dtype=torch.float64)
    torch.testing.assert_close(X @ a, X @ A, rtol=1e-13, atol=1e-13)
    assert a.block_calls == 1
    v = torch.randn(N, dtype=torch.float64)
    torch.testing.assert_close(v @ a, v @ A, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match=rf"shape \(m, {N}\)"):
        torch.randn(3, N + 1, dtype=torch.float64) @ a


def test_sums_of_real_operators_against_dense_oracles() -> None:
    model = mlp()
    data = classification_data(n=10)
    params = select_parameters(model)
    ce = nn.CrossEntropyLoss()
    hess = HessianOperator(model, data, supervised_loss(ce))
    ggn = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(ce))
    H = dense_hessian(model, data, supervised_loss(ce), params)
    G = dense_ggn(model, data, supervised_forward, supervised_loss_of_output(ce), params)
    # H - G is the part of the Hessian from the network's second derivatives
    torch.testing.assert_close((hess - ggn).to_dense(), H - G, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close((0.5 * hess + ggn / 2).to_dense(), (H + G) / 2, rtol=1e-9, atol=1e-11)
    assert hess.num_matvecs == ggn.num_matvecs == 2 * hess.size


def test_combinations_of_model_operators_keep_the_parameter_layout() -> None:
    curvlinops = pytest.importorskip("curvlinops")
    from hessian_eigenthings import interop

    model = mlp()
    data = classification_data(n=10)
    ce = nn.CrossEntropyLoss()
    hess = HessianOperator(model, data, supervised_loss(ce))
    ggn = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(ce))
    s = hess - 2 * ggn
    assert s.layout is hess.layout  # type: ignore[attr-defined]
    A = interop.to_curvlinops(s)
    assert isinstance(A, curvlinops._torch_base.PyTorchLinearOperator)
    # the tensor-list format, in the parameters' shapes
    xs = [torch.randn(*p.shape, dtype=torch.float64) for p in model.parameters()]
    flat = torch.cat([x.reshape(-1) for x in xs])
    expected = hess @ flat - 2 * (ggn @ flat)
    torch.testing.assert_close(torch.cat([y.reshape(-1) for y in A @ xs]), expected, rtol=1e-10, atol=1e-12)
    # a part over other parameters: no shared layout, a flat operator
    last = HessianOperator(model, data, supervised_loss(ce), param_filter="2.*")
    assert not hasattr(last + LambdaOperator(lambda v: v, last.size, dtype=torch.float64) + last.submatrix(slice(None)), "layout")


@pytest.mark.parametrize(
    "rows",
    [torch.tensor([0, 3, 4, 8]), [0, 3, 4, 8], slice(2, 7), torch.arange(N) % 2 == 0, range(1, 9, 3)],
    ids=["tensor", "list", "slice", "mask", "range"],
)
def test_square_submatrix_is_a_symmetric_operator(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor], rows: object) -> None:
    a, _, A, _ = pair
    idx = torch.arange(N)[rows] if not isinstance(rows, (list, range)) else torch.tensor(list(rows))
    sub = a.submatrix(rows)
    assert isinstance(sub, SubmatrixOperator) and sub.size == len(idx)
    torch.testing.assert_close(sub.to_dense(), A[idx][:, idx], rtol=1e-13, atol=1e-13)
    again = a.submatrix(rows, idx.clone())  # equal rows and cols: still symmetric
    assert isinstance(again, SubmatrixOperator)
    # an eigensolver accepts it
    top = he.lanczos(sub, k=1, which="LA", seed=0, tol=1e-10)
    torch.testing.assert_close(top.eigenvalues[0], torch.linalg.eigvalsh(A[idx][:, idx])[-1], rtol=1e-9, atol=1e-10)


def test_repeated_indices_keep_the_submatrix_exact(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, _, A, _ = pair
    idx = torch.tensor([2, 2, 5])
    torch.testing.assert_close(a.submatrix(idx).to_dense(), A[idx][:, idx], rtol=1e-13, atol=1e-13)


def test_rectangular_submatrix(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, _, A, _ = pair
    rows, cols = torch.tensor([0, 2, 5]), torch.tensor([1, 2, 7, 8])
    sub = a.submatrix(rows, cols)
    assert isinstance(sub, RectangularSubmatrix) and not isinstance(sub, CurvatureOperator)
    dense = A[rows][:, cols]
    assert sub.shape == (3, 4)
    u, w = torch.randn(4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    U = torch.randn(4, 2, dtype=torch.float64)
    torch.testing.assert_close(sub.to_dense(), dense, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(sub.matvec(u), dense @ u, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(sub @ U, dense @ U, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(sub.rmatvec(w), dense.T @ w, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(sub.T.to_dense(), dense.T, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(U.T @ sub.T, (sub @ U).T, rtol=1e-13, atol=1e-13)
    sp = sub.to_scipy()
    np.testing.assert_allclose(sp.matvec(u.numpy()), (dense @ u).numpy(), rtol=1e-12)
    np.testing.assert_allclose(sp.rmatvec(w.numpy()), (dense.T @ w).numpy(), rtol=1e-12)
    np.testing.assert_allclose(sp.matmat(U.numpy()), (dense @ U).numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        sub.matvec(w)
    with pytest.raises(TypeError, match="CurvatureOperator"):
        he.lanczos(sub, k=1)  # type: ignore[arg-type]


def test_bad_combinations_are_refused(pair: tuple[Dense, Dense, torch.Tensor, torch.Tensor]) -> None:
    a, _, _, _ = pair
    with pytest.raises(ValueError, match="different sizes"):
        a + LambdaOperator(lambda v: v, N + 1, dtype=torch.float64)
    with pytest.raises(TypeError, match="different dtypes"):
        a - LambdaOperator(lambda v: v, N, dtype=torch.float32)
    with pytest.raises(TypeError, match="damping"):
        a + torch.eye(N, dtype=torch.float64)  # type: ignore[operator]
    with pytest.raises(TypeError, match="scalar"):
        a * torch.ones(N, dtype=torch.float64)  # type: ignore[operator]
    with pytest.raises(TypeError, match="real scalar"):
        a * "2"  # type: ignore[operator]
    with pytest.raises(ValueError, match="finite"):
        a * float("inf")
    with pytest.raises(ZeroDivisionError):
        a / 0
    with pytest.raises(ValueError, match=r"in \[0, 9\)"):
        a.submatrix([0, N])
    with pytest.raises(ValueError, match="selects nothing"):
        a.submatrix([])
    with pytest.raises(TypeError, match="integers or bools"):
        a.submatrix(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"bool mask must have shape \(9,\)"):
        a.submatrix(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="slice"):
        a.submatrix(3)
