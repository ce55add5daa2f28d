"""``JacobianOperator`` / ``TransposedJacobianOperator``: the output Jacobian over the data,
``(N·C, n)`` and ``(n, N·C)``, against dense float64 Jacobians from ``torch.func.jacrev``
(``curvature_oracles.jacobian``) stacked per batch, and against curvlinops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hessian_eigenthings import JacobianOperator, TransposedJacobianOperator
from hessian_eigenthings.loss_fns import supervised_forward
from hessian_eigenthings.param_utils import select_parameters
from tests.conftest import SmallCNN, mlp
from tests.operators.curvature_oracles import jacobian


def _data(x_shape: tuple[int, ...], n: int = 7, batch: int = 3):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    X = torch.randn(n, *x_shape, generator=g, dtype=torch.float64)
    Y = torch.zeros(n)
    return [(X[i : i + batch], Y[i : i + batch]) for i in range(0, n, batch)]  # 3 + 3 + 1


def _dense(model: nn.Module, data: list, param_filter: object = None) -> torch.Tensor:  # type: ignore[type-arg]
    named = select_parameters(model, param_filter)  # type: ignore[arg-type]
    return torch.cat([jacobian(model, b, supervised_forward, named) for b in data])


CASES = {
    "mlp": (lambda: mlp(5, 6, 3), (5,), None),
    "cnn-eval": (lambda: SmallCNN().double().eval(), (2, 4, 4), None),
    "mlp-last-layer": (lambda: mlp(5, 6, 3), (5,), "2.*"),
}


@pytest.mark.parametrize("case", CASES)
def test_products_match_the_dense_jacobian(case: str) -> None:
    make, x_shape, flt = CASES[case]
    model = make()
    data = _data(x_shape)
    J = JacobianOperator(model, data, supervised_forward, param_filter=flt)  # type: ignore[arg-type]
    ref = _dense(model, data, flt)
    m, n = ref.shape
    assert J.shape == (m, n) and J.T.shape == (n, m)
    g = torch.Generator().manual_seed(0)
    v, V = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(n, 4, generator=g, dtype=torch.float64),
    )
    u, U = (
        torch.randn(m, generator=g, dtype=torch.float64),
        torch.randn(m, 2, generator=g, dtype=torch.float64),
    )
    close = {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(J @ v, ref @ v, **close)
    torch.testing.assert_close(J @ V, ref @ V, **close)
    torch.testing.assert_close(J.rmatvec(u), ref.T @ u, **close)
    torch.testing.assert_close(U.T @ J, U.T @ ref, **close)
    torch.testing.assert_close(J.T @ U, ref.T @ U, **close)
    torch.testing.assert_close(J.T.T @ V, ref @ V, **close)
    torch.testing.assert_close(J.to_dense(), ref, **close)
    assert J.num_matvecs == 1 + 4 + 1 + 2 + n  # the transposes count in their own operators


def test_transposed_operator_built_directly_and_scipy() -> None:
    model = mlp(5, 6, 3)
    data = _data((5,))
    JT = TransposedJacobianOperator(model, data, supervised_forward)
    ref = _dense(model, data).T
    torch.testing.assert_close(JT.to_dense(), ref, rtol=1e-10, atol=1e-12)
    A = JT.to_scipy()
    x = np.random.default_rng(0).standard_normal(ref.shape[1])
    np.testing.assert_allclose(A @ x, (ref.numpy() @ x), rtol=1e-10, atol=1e-12)
    y = np.random.default_rng(1).standard_normal(ref.shape[0])
    np.testing.assert_allclose(A.rmatvec(y), ref.numpy().T @ y, rtol=1e-10, atol=1e-12)


def test_training_batchnorm_uses_batch_statistics_and_leaves_the_model_alone() -> None:
    model = SmallCNN().double()  # training mode: the Jacobian of the batch-statistics forward
    data = _data((2, 4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    J = JacobianOperator(model, data, supervised_forward)
    v = torch.randn(J.shape[1], dtype=torch.float64)
    # the oracle clones the buffers too: the same batch-statistics forward
    torch.testing.assert_close(J @ v, _dense(model, data) @ v, rtol=1e-10, atol=1e-12)
    J.rmatvec(torch.randn(J.shape[0], dtype=torch.float64))
    for k, t in model.state_dict().items():
        assert torch.equal(t, before[k]), k
    assert model.training


def test_clear_errors() -> None:
    model = mlp(5, 6, 3)
    J = JacobianOperator(model, _data((5,)), supervised_forward)
    with pytest.raises(ValueError, match=r"\(57,\)"):
        J @ torch.zeros(J.shape[1] + 1, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype"):
        J @ torch.zeros(J.shape[1])
    with pytest.raises(TypeError, match="iterated again"):
        JacobianOperator(model, iter(_data((5,))), supervised_forward)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
def test_matches_curvlinops() -> None:
    curvlinops = pytest.importorskip("curvlinops")
    model = SmallCNN().double().eval()
    data = _data((2, 4, 4))
    params = list(model.parameters())
    ours = JacobianOperator(model, data, supervised_forward)
    theirs = curvlinops.JacobianLinearOperator(model, params, data)
    theirs_t = curvlinops.TransposedJacobianLinearOperator(model, params, data)
    g = torch.Generator().manual_seed(1)
    V = torch.randn(ours.shape[1], 3, generator=g, dtype=torch.float64)
    U = torch.randn(ours.shape[0], 2, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ours @ V, theirs @ V, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.T @ U, theirs_t @ U, rtol=1e-10, atol=1e-12)


def test_num_batches_takes_the_first_batches_in_order() -> None:
    model = mlp(5, 6, 3)
    data = _data((5,))
    J = JacobianOperator(model, data, supervised_forward, num_batches=2)
    assert J.shape == (2 * 3 * 3, 57)
    torch.testing.assert_close(J.to_dense(), _dense(model, data[:2]), rtol=1e-10, atol=1e-12)
