"""KFOC against dense float64 references: each block is the nearest Kronecker product (by SVD of
the Van Loan-Pitsianis rearrangement in numpy) of the exact GGN block, built densely; equal to
KFAC where KFAC is exact (also against curvlinops' KFAC there); batch-size weighting, parameter
subsets, input errors, and the Kronecker algebra against dense linear algebra."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings import KFACOperator, KFOCOperator
from hessian_eigenthings.loss_fns import (
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
)
from hessian_eigenthings.param_utils import select_parameters
from tests.operators.curvature_oracles import dense_ggn

CE = cross_entropy_loss_of_output()
MSE = mse_loss_of_output()
TIGHT = {"max_iter": 500, "tol": 1e-13}


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    ).double()


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    ).double()


def _data(kind: str, loss: object, n: int = 7, split: int = 4) -> list:  # type: ignore[type-arg]
    X = torch.randn(n, 4) if kind == "mlp" else torch.randn(n, 2, 6, 6)
    y = torch.randint(0, 3, (n,)) if loss is CE else torch.randn(n, 3, dtype=torch.float64)
    X = X.double()
    return [(X[:split], y[:split]), (X[split:], y[split:])]  # the last batch is shorter


def _ggn(model: nn.Module, data: list, loss: object, param_filter: object = None) -> torch.Tensor:  # type: ignore[type-arg]
    return dense_ggn(model, data, supervised_forward, loss, select_parameters(model, param_filter))  # type: ignore[arg-type]


def _block_index(op: KFOCOperator | KFACOperator, names: tuple[str, ...]) -> torch.Tensor:
    """Flat indices of a block's matrix ``X (m, q)`` in row-major order: each weight row, then
    that row's bias entry when the bias is joined to the weight."""
    start = dict(zip(op.layout.names, op.layout.offsets[:-1], strict=True))
    shapes = dict(zip(op.layout.names, op.layout.shapes, strict=True))
    columns = []
    for name in names:
        m = shapes[name][0]
        width = int(np.prod(shapes[name][1:])) if len(shapes[name]) > 1 else 1
        columns.append(start[name] + torch.arange(m * width).reshape(m, width))
    return torch.cat(columns, dim=1).reshape(-1)


def _nearest_kronecker(B: np.ndarray, m: int, q: int) -> np.ndarray:
    """``σ₁ u₁ ⊗ v₁`` from the SVD of the rearrangement ``R[(r,r'),(s,s')] = B[(r,s),(r',s')]``."""
    R = B.reshape(m, q, m, q).transpose(0, 2, 1, 3).reshape(m * m, q * q)
    U, S, Vt = np.linalg.svd(R)
    return S[0] * np.kron(U[:, 0].reshape(m, m), Vt[0].reshape(q, q))


def _blocks_and_oracle(op: KFOCOperator | KFACOperator, ggn: torch.Tensor) -> list:  # type: ignore[type-arg]
    """Per block: (indices, the operator's block, the exact GGN block)."""
    dense = op.to_dense()
    out = []
    for block in op.factors:
        idx = _block_index(op, block.names)
        sub = (idx.unsqueeze(1), idx.unsqueeze(0))
        out.append((block, dense[sub], ggn[sub]))
    return out


# -- against the dense nearest Kronecker product ---------------------------------------------
@pytest.mark.parametrize("separate", [True, False], ids=["separate", "joint"])
@pytest.mark.parametrize(
    ("kind", "loss"), [("mlp", CE), ("mlp", MSE), ("cnn", CE)], ids=["mlp-ce", "mlp-mse", "cnn-ce"]
)
def test_each_block_is_the_nearest_kronecker_product_of_the_ggn_block(
    kind: str, loss: object, separate: bool
) -> None:
    torch.manual_seed(0)
    model = _mlp() if kind == "mlp" else _cnn()
    data = _data(kind, loss)
    op = KFOCOperator(model, data, supervised_forward, loss, separate_bias=separate, **TIGHT)  # type: ignore[arg-type]
    assert op.converged
    ggn = _ggn(model, data, loss)
    covered = torch.zeros(op.size, op.size, dtype=torch.bool)
    for block, ours, exact in _blocks_and_oracle(op, ggn):
        m, q = block.G.shape[0], block.A.shape[0]
        expected = torch.from_numpy(_nearest_kronecker(exact.numpy(), m, q))
        torch.testing.assert_close(ours, expected, rtol=1e-8, atol=1e-12 * float(exact.norm()))
        torch.testing.assert_close(ours, torch.kron(block.G, block.A), rtol=1e-12, atol=1e-15)
        # the factors are symmetric PSD with balanced norms
        for F in (block.G, block.A):
            torch.testing.assert_close(F, F.T, rtol=0, atol=1e-14)
            assert float(torch.linalg.eigvalsh(F).min()) >= -1e-10 * float(F.norm())
        if q > 1:
            torch.testing.assert_close(block.G.norm(), block.A.norm(), rtol=1e-10, atol=0)
        idx = _block_index(op, block.names)
        covered[idx.unsqueeze(1), idx.unsqueeze(0)] = True
    assert not op.to_dense()[~covered].any()  # nothing outside the blocks


def test_kfoc_is_at_least_as_close_to_each_block_as_kfac() -> None:
    torch.manual_seed(1)
    model, data = _cnn(), _data("cnn", CE)
    ggn = _ggn(model, data, CE)
    kfoc = KFOCOperator(model, data, supervised_forward, CE, separate_bias=False, **TIGHT)
    kfac = KFACOperator(model, data, supervised_forward, CE, separate_bias=False)
    strictly = 0
    for (_, ours, exact), (_, theirs, _) in zip(
        _blocks_and_oracle(kfoc, ggn), _blocks_and_oracle(kfac, ggn), strict=True
    ):
        err_kfoc, err_kfac = float((ours - exact).norm()), float((theirs - exact).norm())
        assert err_kfoc <= err_kfac * (1 + 1e-10)
        strictly += err_kfoc < 0.99 * err_kfac
    assert strictly >= 1  # on a CNN with several samples KFAC is not optimal


def test_positions_as_loss_terms_on_a_per_token_network() -> None:
    # Linear layers over sequences (N, T, d) with a loss term per token: each position is its own
    # term, so the exact block sums one outer product per (sample, position) (the CNN classifier
    # above covers weight sharing within one term per sample)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(5, 6, 3, dtype=torch.float64), torch.randn(5, 6, 2, dtype=torch.float64)
    data = [(x[:3], y[:3]), (x[3:], y[3:])]
    op = KFOCOperator(model, data, supervised_forward, MSE, weight_sharing="position", **TIGHT)
    for block, ours, exact in _blocks_and_oracle(op, _ggn(model, data, MSE)):
        m, q = block.G.shape[0], block.A.shape[0]
        expected = torch.from_numpy(_nearest_kronecker(exact.numpy(), m, q))
        torch.testing.assert_close(ours, expected, rtol=1e-8, atol=1e-12 * float(exact.norm()))
    with pytest.raises(ValueError, match=r"6 loss terms per sample.*weight_sharing='position'"):
        KFOCOperator(model, data, supervised_forward, MSE)


# -- where KFAC is exact ---------------------------------------------------------------------
@pytest.mark.parametrize("separate", [True, False], ids=["separate", "joint"])
@pytest.mark.parametrize("loss", [CE, MSE], ids=["ce", "mse"])
def test_one_data_point_equals_kfac(loss: object, separate: bool) -> None:
    torch.manual_seed(3)
    model = _mlp()
    x = torch.randn(1, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (1,)) if loss is CE else torch.randn(1, 3, dtype=torch.float64)
    data = [(x, y)]
    kfoc = KFOCOperator(model, data, supervised_forward, loss, separate_bias=separate)  # type: ignore[arg-type]
    kfac = KFACOperator(model, data, supervised_forward, loss, separate_bias=separate)  # type: ignore[arg-type]
    torch.testing.assert_close(kfoc.to_dense(), kfac.to_dense(), rtol=1e-10, atol=1e-14)
    # the rearranged block has rank one: the second iteration no longer moves the factors
    assert kfoc.converged and kfoc.iterations == 2


@pytest.mark.parametrize("fisher_type", ["mc", "empirical"])
def test_other_fisher_types_on_one_data_point_equal_kfac(fisher_type: str) -> None:
    # the Monte-Carlo targets are seeded by the batch's position: every pass of the power
    # iteration sees the same ones (else the block would change between passes)
    torch.manual_seed(10)
    model = _mlp()
    data = [(torch.randn(1, 4, dtype=torch.float64), torch.tensor([1]))]
    options = {"fisher_type": fisher_type, "mc_samples": 3 if fisher_type == "mc" else 1}
    kfoc = KFOCOperator(model, data, supervised_forward, CE, **options)  # type: ignore[arg-type]
    kfac = KFACOperator(model, data, supervised_forward, CE, **options)  # type: ignore[arg-type]
    torch.testing.assert_close(kfoc.to_dense(), kfac.to_dense(), rtol=1e-10, atol=1e-14)


def test_single_linear_layer_mse_is_the_exact_ggn() -> None:
    torch.manual_seed(4)
    model = nn.Linear(4, 3).double()
    data = _data("mlp", MSE)
    op = KFOCOperator(model, data, supervised_forward, MSE, separate_bias=False)
    torch.testing.assert_close(op.to_dense(), _ggn(model, data, MSE), rtol=1e-10, atol=1e-14)


def test_one_data_point_matches_curvlinops_kfac() -> None:
    # curvlinops 3.0.1 has no KFOC; where KFAC is exact both must give the same matrix
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(5)
    model = _mlp()  # no weight sharing: one sample's block is a Kronecker product
    x, y = torch.randn(1, 4, dtype=torch.float64), torch.randint(0, 3, (1,))
    ours = KFOCOperator(model, [(x, y)], supervised_forward, CE, separate_bias=False)
    params = list(model.parameters())
    theirs = curvlinops.KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        params,
        [(x, y)],
        check_deterministic=False,
        fisher_type="type-2",
        separate_weight_and_bias=False,
    )
    eye = torch.eye(ours.size, dtype=torch.float64)
    torch.testing.assert_close(ours.to_dense(), theirs @ eye, rtol=1e-10, atol=1e-14)


# -- data and parameters ---------------------------------------------------------------------
def test_batches_weighted_by_size_with_an_uneven_last_batch() -> None:
    torch.manual_seed(6)
    model = _mlp()
    (X1, y1), (X2, y2) = _data("mlp", CE, n=7, split=5)
    whole = [(torch.cat([X1, X2]), torch.cat([y1, y2]))]
    split = KFOCOperator(model, [(X1, y1), (X2, y2)], supervised_forward, CE, **TIGHT)
    one = KFOCOperator(model, whole, supervised_forward, CE, **TIGHT)
    torch.testing.assert_close(split.to_dense(), one.to_dense(), rtol=1e-9, atol=1e-13)


def test_param_filter_subset() -> None:
    torch.manual_seed(7)
    model, data = _mlp(), _data("mlp", CE)
    subset = ["2.weight", "0.bias", "4.bias"]
    op = KFOCOperator(model, data, supervised_forward, CE, param_filter=subset, **TIGHT)
    assert op.layout.names == ("0.bias", "2.weight", "4.bias")  # named_parameters order
    ggn = _ggn(model, data, CE, param_filter=subset)
    for block, ours, exact in _blocks_and_oracle(op, ggn):
        m, q = block.G.shape[0], block.A.shape[0]
        expected = torch.from_numpy(_nearest_kronecker(exact.numpy(), m, q))
        torch.testing.assert_close(ours, expected, rtol=1e-8, atol=1e-12 * float(exact.norm()))
    # a bias on its own: its block is exact (G ⊗ [1] is any m × m matrix)
    bias = KFOCOperator(model, data, supervised_forward, CE, param_filter=["4.bias"])
    exact_bias = _ggn(model, data, CE, param_filter=["4.bias"])
    torch.testing.assert_close(bias.to_dense(), exact_bias, rtol=1e-10, atol=1e-14)
    assert bias.iterations == 0 and bias.converged


def test_errors_name_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 3)).double()
    data = _data("mlp", CE)
    with pytest.raises(ValueError, match=r"1\.weight \(LayerNorm\), 1\.bias \(LayerNorm\)"):
        KFOCOperator(model, data, supervised_forward, CE)
    op = KFOCOperator(model, data, supervised_forward, CE, exclude_unsupported=True)
    assert op.excluded_parameters == ("1.weight (LayerNorm)", "1.bias (LayerNorm)")
    with pytest.raises(ValueError, match="max_iter must be an int >= 1"):
        KFOCOperator(model, data, supervised_forward, CE, exclude_unsupported=True, max_iter=0)
    with pytest.raises(ValueError, match="tol must be a finite number >= 0"):
        KFOCOperator(model, data, supervised_forward, CE, exclude_unsupported=True, tol=-1.0)
    with pytest.raises(ValueError, match="weight_sharing must be 'sample' or 'position'"):
        KFOCOperator(model, data, supervised_forward, CE, weight_sharing="expand")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fisher_type must be"):
        KFOCOperator(
            model,
            data,
            supervised_forward,
            CE,
            exclude_unsupported=True,
            fisher_type="exact",  # type: ignore[arg-type]
        )


def test_max_iter_bounds_the_passes_and_reports_convergence() -> None:
    torch.manual_seed(8)
    model, data = _cnn(), _data("cnn", CE)
    short = KFOCOperator(model, data, supervised_forward, CE, max_iter=1, tol=0.0)
    assert (short.iterations, short.converged) == (1, False)
    assert "iterations=1, converged=False" in repr(short)


# -- the algebra, through KFAC's block machinery --------------------------------------------
def test_inverse_eigh_logdet_trace_norm_against_dense_linear_algebra() -> None:
    torch.manual_seed(9)
    model, data = _cnn(), _data("cnn", CE)
    op = KFOCOperator(model, data, supervised_forward, CE, separate_bias=False)
    K = op.to_dense()
    damping = 0.1
    eye = torch.eye(op.size, dtype=torch.float64)
    torch.testing.assert_close(
        op.inverse(damping).to_dense(), torch.linalg.inv(K + damping * eye), rtol=1e-8, atol=1e-10
    )
    torch.testing.assert_close(
        op.eigh().eigenvalues, torch.linalg.eigvalsh(K), rtol=1e-8, atol=1e-12
    )
    torch.testing.assert_close(
        op.logdet(damping), torch.logdet(K + damping * eye), rtol=1e-10, atol=0
    )
    torch.testing.assert_close(op.trace(), K.trace(), rtol=1e-12, atol=0)
    torch.testing.assert_close(op.frobenius_norm(), K.norm(), rtol=1e-12, atol=0)
    # and it is a CurvatureOperator the algorithms take
    top = he.lanczos(op, k=1, which="LA", seed=0)
    torch.testing.assert_close(top.eigenvalues[0], torch.linalg.eigvalsh(K)[-1], rtol=1e-6, atol=0)
