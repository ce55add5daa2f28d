"""``op.block(param_filter)``: the submatrix on the coordinates of some of the operator's own
parameters, against slices of dense float64 matrices, against the operator built over those
parameters alone, and (with ``op.submatrix``) against curvlinops' SubmatrixLinearOperator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings import interop
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import (
    GGNOperator,
    HessianOperator,
    LambdaOperator,
    SubmatrixOperator,
)
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.conftest import classification_data, mlp
from tests.operators.curvature_oracles import dense_ggn

CE = nn.CrossEntropyLoss()


def _indices(model: nn.Module, names: list[str]) -> torch.Tensor:
    """Flat coordinates of ``names`` in ``model.parameters()`` order, by hand."""
    out, start = [], 0
    for name, p in model.named_parameters():
        if name in names:
            out.append(torch.arange(start, start + p.numel()))
        start += p.numel()
    return torch.cat(out)


@pytest.mark.parametrize(
    "flt, names",
    [
        ("2.*", ["2.weight", "2.bias"]),
        (["0.bias", "2.weight"], ["0.bias", "2.weight"]),  # not contiguous
        (lambda name, p: p.dim() == 1, ["0.bias", "2.bias"]),  # a callable sees the parameter
    ],
    ids=["glob", "globs-gapped", "callable"],
)
def test_block_is_the_slice_of_the_dense_matrix_and_the_operator_over_those_parameters(
    flt: object, names: list[str]
) -> None:
    model = mlp(5, 6, 3)
    data = classification_data(n=7, batch=3)  # uneven last batch
    ggn = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE))
    blk = ggn.block(flt)
    assert isinstance(blk, SubmatrixOperator) and list(blk.layout.names) == names
    idx = _indices(model, names)
    full = dense_ggn(
        model, data, supervised_forward, supervised_loss_of_output(CE), select_parameters(model)
    )
    torch.testing.assert_close(blk.to_dense(), full[idx][:, idx], rtol=1e-10, atol=1e-12)
    # the same block computed by a GGN over those parameters only
    alone = GGNOperator(
        model, data, supervised_forward, supervised_loss_of_output(CE), param_filter=flt
    )  # type: ignore[arg-type]
    torch.testing.assert_close(blk.to_dense(), alone.to_dense(), rtol=1e-10, atol=1e-12)


def test_block_of_a_block_and_of_a_combination() -> None:
    model = mlp(5, 6, 3)
    data = classification_data(n=7, batch=3)
    hess = HessianOperator(model, data, supervised_loss(CE))
    ggn = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE))
    H = dense_hessian(model, data, supervised_loss(CE), select_parameters(model))
    G = dense_ggn(
        model, data, supervised_forward, supervised_loss_of_output(CE), select_parameters(model)
    )
    idx = _indices(model, ["2.weight"])
    inner = ggn.block("2.*").block("*.weight")
    torch.testing.assert_close(inner.to_dense(), G[idx][:, idx], rtol=1e-10, atol=1e-12)
    combo = (hess - ggn).block(
        lambda name, p: p.shape == (3, 6)
    )  # a combination: the filter sees shapes
    torch.testing.assert_close(combo.to_dense(), (H - G)[idx][:, idx], rtol=1e-10, atol=1e-12)
    # the block keeps its layout: the curvlinops adapter speaks its tensor lists
    pytest.importorskip("curvlinops")
    A = interop.to_curvlinops(inner)
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(
        A @ [x], [(G[idx][:, idx] @ x.reshape(-1)).reshape(3, 6)], rtol=1e-10, atol=1e-12
    )


def test_block_refusals() -> None:
    model = mlp(5, 6, 3)
    ggn = GGNOperator(
        model, classification_data(n=7), supervised_forward, supervised_loss_of_output(CE)
    )
    with pytest.raises(ValueError, match="selected none"):
        ggn.block("nothing.*")
    with pytest.raises(TypeError, match="submatrix"):
        LambdaOperator(lambda v: v, 4, dtype=torch.float64).block("*")
    with pytest.raises(TypeError, match="param_filter"):
        ggn.block(3)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
def test_submatrix_and_block_match_curvlinops_submatrix() -> None:
    curvlinops = pytest.importorskip("curvlinops")
    model = mlp(5, 6, 3)
    data = classification_data(n=7, batch=3)
    ggn = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE))
    theirs_ggn = curvlinops.GGNLinearOperator(model, CE, list(model.parameters()), data)
    rows, cols = [0, 5, 17, 40, 56], [3, 5, 30, 31]
    theirs = curvlinops.SubmatrixLinearOperator(theirs_ggn, rows, cols)
    V = torch.randn(len(cols), 2, dtype=torch.float64)
    torch.testing.assert_close(ggn.submatrix(rows, cols) @ V, theirs @ V, rtol=1e-10, atol=1e-12)
    idx = _indices(model, ["0.bias", "2.weight"]).tolist()
    theirs_blk = curvlinops.SubmatrixLinearOperator(theirs_ggn, idx, idx)
    W = torch.randn(len(idx), 3, dtype=torch.float64)
    torch.testing.assert_close(
        ggn.block(["0.bias", "2.weight"]) @ W, theirs_blk @ W, rtol=1e-10, atol=1e-12
    )
