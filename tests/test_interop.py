"""scipy and curvlinops interoperability: same numbers through every door."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import eigsh
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings import interop
from tests.conftest import mlp

try:
    interop._import_curvlinops_base()  # imports curvlinops with its third-party import noise silenced
    import curvlinops
except ImportError:  # pragma: no cover - depends on the environment
    curvlinops = None

needs_curvlinops = pytest.mark.skipif(curvlinops is None, reason="curvlinops is not installed")


def _problem() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(4)
    model = mlp()
    # uneven last batch: both libraries weight batches by size
    sizes = (8, 8, 5)
    data = [
        (torch.randn(b, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen))
        for b in sizes
    ]
    return model, data


def test_eigsh_on_to_scipy_matches_lanczos() -> None:
    model, data = _problem()
    op = he.HessianOperator(model, data, he.supervised_loss(nn.CrossEntropyLoss()))
    ours = he.lanczos(op, k=4, which="LA", tol=1e-10, seed=0)
    theirs = np.sort(eigsh(op.to_scipy(), k=4, which="LA", tol=1e-12)[0])[::-1]
    np.testing.assert_allclose(ours.eigenvalues.numpy(), theirs, rtol=1e-8, atol=1e-10)
    # ... and both match the dense matrix
    dense = torch.linalg.eigvalsh(op.to_dense()).flip(0)[:4]
    np.testing.assert_allclose(theirs, dense.numpy(), rtol=1e-8, atol=1e-10)


def test_eigsh_smallest_on_ggn() -> None:
    model, data = _problem()
    op = he.GGNOperator(model, data, he.supervised_forward, he.supervised_loss_of_output(nn.CrossEntropyLoss()))
    ours = he.lanczos(op, k=3, which="LM", tol=1e-10, seed=0)
    theirs = np.sort(np.abs(eigsh(op.to_scipy(), k=3, which="LM", tol=1e-12)[0]))[::-1]
    np.testing.assert_allclose(ours.eigenvalues.abs().numpy(), theirs, rtol=1e-8, atol=1e-10)


@needs_curvlinops
def test_from_curvlinops_hessian_matches_both_libraries() -> None:
    model, data = _problem()
    params = list(model.parameters())
    H = curvlinops.HessianLinearOperator(model, nn.CrossEntropyLoss(), params, data, check_deterministic=False)
    ours = he.HessianOperator(model, data, he.supervised_loss(nn.CrossEntropyLoss()))
    wrapped = interop.from_curvlinops(H)
    assert isinstance(wrapped, he.CurvatureOperator)
    assert (wrapped.size, wrapped.dtype, wrapped.device) == (ours.size, torch.float64, torch.device("cpu"))

    V = torch.randn(ours.size, 3, dtype=torch.float64)
    torch.testing.assert_close(wrapped @ V, H @ V)
    torch.testing.assert_close(wrapped @ V[:, 0], H @ V[:, 0])
    torch.testing.assert_close(wrapped @ V, ours @ V, rtol=1e-10, atol=1e-12)

    top = he.lanczos(wrapped, k=3, which="LA", tol=1e-10, seed=0)
    ref = he.lanczos(ours, k=3, which="LA", tol=1e-10, seed=0)
    torch.testing.assert_close(top.eigenvalues, ref.eigenvalues, rtol=1e-8, atol=1e-10)


@needs_curvlinops
def test_to_curvlinops_matches_curvlinops_products() -> None:
    model, data = _problem()
    params = list(model.parameters())
    H = curvlinops.HessianLinearOperator(model, nn.CrossEntropyLoss(), params, data, check_deterministic=False)
    op = he.HessianOperator(model, data, he.supervised_loss(nn.CrossEntropyLoss()))
    A = interop.to_curvlinops(op)
    assert isinstance(A, curvlinops._torch_base.PyTorchLinearOperator)
    assert A.shape == H.shape and A.adjoint() is A

    V = torch.randn(op.size, 4, dtype=torch.float64)
    torch.testing.assert_close(A @ V, H @ V, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(A @ V[:, 1], H @ V[:, 1], rtol=1e-10, atol=1e-12)
    # tensor-list format in the parameters' shapes, vectors and matrices
    Xs = [torch.randn(*p.shape, 2, dtype=torch.float64) for p in params]
    for a, h in zip(A @ Xs, H @ Xs, strict=True):
        torch.testing.assert_close(a, h, rtol=1e-10, atol=1e-12)
    xs = [x[..., 0] for x in Xs]
    for a, h in zip(A @ xs, H @ xs, strict=True):
        torch.testing.assert_close(a, h, rtol=1e-10, atol=1e-12)
    # curvlinops' own algebra and estimators accept it
    torch.testing.assert_close((A - H) @ V, torch.zeros_like(V), rtol=0, atol=1e-12)
    torch.manual_seed(1)
    ours = float(curvlinops.hutchpp_trace(A, 30))
    torch.manual_seed(1)
    assert ours == pytest.approx(float(curvlinops.hutchpp_trace(H, 30)), rel=1e-8)
    np.testing.assert_allclose(A.to_scipy() @ V.numpy(), (H @ V).numpy(), rtol=1e-10, atol=1e-12)


@needs_curvlinops
def test_ggn_adapters_agree_with_curvlinops_ggn() -> None:
    model, data = _problem()
    params = list(model.parameters())
    G = curvlinops.GGNLinearOperator(model, nn.CrossEntropyLoss(), params, data, check_deterministic=False)
    ours = he.GGNOperator(model, data, he.supervised_forward, he.supervised_loss_of_output(nn.CrossEntropyLoss()))
    V = torch.randn(ours.size, 3, dtype=torch.float64)
    torch.testing.assert_close(interop.from_curvlinops(G) @ V, ours @ V, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(interop.to_curvlinops(ours) @ V, G @ V, rtol=1e-9, atol=1e-12)


@needs_curvlinops
def test_to_curvlinops_of_lambda_operator_is_flat() -> None:
    M = torch.randn(6, 6, dtype=torch.float64)
    M = M + M.T
    A = interop.to_curvlinops(he.LambdaOperator(lambda v: M @ v, 6, dtype=torch.float64))
    X = torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(A @ X, M @ X)
    back = interop.from_curvlinops(A)
    torch.testing.assert_close(back.to_dense(), M)


@needs_curvlinops
def test_adapter_errors() -> None:
    with pytest.raises(TypeError, match="PyTorchLinearOperator"):
        interop.from_curvlinops(torch.eye(3))
    with pytest.raises(TypeError, match="CurvatureOperator"):
        interop.to_curvlinops(torch.eye(3))

    class Rect(curvlinops._torch_base.PyTorchLinearOperator):
        def __init__(self) -> None:
            super().__init__([(2,)], [(3,)])

    with pytest.raises(ValueError, match="square"):
        interop.from_curvlinops(Rect())

    class NotSymmetric(curvlinops._torch_base.PyTorchLinearOperator):
        def __init__(self) -> None:
            super().__init__([(3,)], [(3,)])

        device = torch.device("cpu")
        dtype = torch.float64

    with pytest.raises(ValueError, match="self-adjoint"):
        interop.from_curvlinops(NotSymmetric())
