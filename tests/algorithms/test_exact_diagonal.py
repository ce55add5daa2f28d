"""``diagonal(op, method="exact")``: the exact diagonal of the GGN (and of its Monte-Carlo
Fisher, same draws as its products) and of the empirical Fisher, by per-sample backprop of a
square root of the loss Hessian (NOTE [exact diagonal] in ``operators.sandwich``). Checked
against the diagonals of dense float64 matrices built independently (``curvature_oracles``),
of the operator's own dense matrix (the MC variant), and of curvlinops' GGN."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.algorithms import diagonal
from hessian_eigenthings.loss_fns import (
    BCEWithLogitsOutputLoss,
    CrossEntropyOutputLoss,
    MSEOutputLoss,
    supervised_forward,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators import EmpiricalFisherOperator, GGNOperator
from hessian_eigenthings.param_utils import select_parameters
from tests.conftest import mlp
from tests.operators.curvature_oracles import dense_empirical_fisher, dense_ggn


class ConvNet(nn.Module):
    """Conv (with bias) + tanh + linear: a small CNN without batch statistics."""

    def __init__(self, out: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def _data(kind: str, x_shape: tuple[int, ...], out: int, n: int = 7, batch: int = 3):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(3)
    X = torch.randn(n, *x_shape, generator=g, dtype=torch.float64)
    if kind == "ce":
        Y = torch.randint(0, out, (n,), generator=g)
    elif kind == "bce":
        Y = (torch.randn(n, out, generator=g) > 0).double()
    else:
        Y = torch.randn(n, out, generator=g, dtype=torch.float64)
    return [(X[i : i + batch], Y[i : i + batch]) for i in range(0, n, batch)]  # 3 + 3 + 1: uneven


CRITERIA = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss, "bce": nn.BCEWithLogitsLoss}
MODELS = {"mlp": (lambda: mlp(5, 6, 3), (5,)), "cnn": (lambda: ConvNet().double(), (2, 4, 4))}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("kind", CRITERIA)
def test_exact_ggn_diagonal_matches_the_dense_ggn(model_name: str, kind: str) -> None:
    make, x_shape = MODELS[model_name]
    model = make()
    data = _data(kind, x_shape, 3)
    loss = supervised_loss_of_output(CRITERIA[kind]())
    op = GGNOperator(model, data, supervised_forward, loss)
    res = diagonal(op, method="exact")
    ref = dense_ggn(model, data, supervised_forward, loss, select_parameters(model)).diagonal()
    torch.testing.assert_close(res.estimate, ref, rtol=1e-10, atol=1e-13)
    assert res.num_matvecs == 0 and op.num_matvecs == 0
    assert bool((res.stderr == 0).all())


@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("reduction, microbatch", [("mean", 2), ("sum", None)])
def test_param_filter_num_batches_microbatches_and_sum_reduction(
    kind: str, reduction: str, microbatch: int | None
) -> None:
    model = mlp(5, 6, 3)
    data = _data(kind, (5,), 3)
    loss = supervised_loss_of_output(CRITERIA[kind](reduction=reduction))
    named = select_parameters(model, "2.*")
    op = GGNOperator(
        model,
        data,
        supervised_forward,
        loss,
        param_filter="2.*",
        num_batches=2,
        microbatch_size=microbatch,
    )
    ref = dense_ggn(model, data[:2], supervised_forward, loss, named).diagonal()
    torch.testing.assert_close(diagonal(op, method="exact").estimate, ref, rtol=1e-10, atol=1e-13)


def test_cross_entropy_over_positions_and_ignored_targets() -> None:
    """Logits (N, C, L): the loss Hessian is block diagonal over positions; -100 rows drop out."""
    model = nn.Conv1d(2, 4, 3, padding=1).double()
    g = torch.Generator().manual_seed(5)
    X = torch.randn(5, 2, 6, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 4, (5, 6), generator=g)
    Y[1, 2:] = -100
    data = [(X[:3], Y[:3]), (X[3:], Y[3:])]
    loss = supervised_loss_of_output(nn.CrossEntropyLoss())
    op = GGNOperator(model, data, supervised_forward, loss)
    ref = dense_ggn(model, data, supervised_forward, loss, select_parameters(model)).diagonal()
    torch.testing.assert_close(diagonal(op, method="exact").estimate, ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize(
    "loss", [CrossEntropyOutputLoss(), MSEOutputLoss(), BCEWithLogitsOutputLoss()], ids=CRITERIA
)
def test_hessian_sqrt_squares_to_the_loss_hessian(loss: object) -> None:
    g = torch.Generator().manual_seed(1)
    output = torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
    y = (
        torch.randint(0, 3, (4, 2), generator=g)
        if isinstance(loss, CrossEntropyOutputLoss)
        else torch.rand(4, 3, 2, generator=g, dtype=torch.float64)
    )
    batch = (None, y)
    S = loss.hessian_sqrt(output, batch)  # type: ignore[attr-defined]
    # Σₙ Σₖ sₙₖ sₙₖᵀ, each column placed at its sample, against the autograd Hessian of the loss
    cols = torch.zeros(S.shape[0], S.shape[1], *output.shape, dtype=S.dtype)
    for n in range(S.shape[0]):
        cols[n, :, n] = S[n]
    flat = cols.reshape(-1, output.numel())
    H = torch.autograd.functional.hessian(lambda o: loss(o, batch), output).reshape(
        output.numel(), -1
    )  # type: ignore[operator]
    torch.testing.assert_close(flat.T @ flat, H, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("kind", CRITERIA)
def test_mc_fisher_diagonal_is_the_diagonal_of_the_operator_it_represents(
    model_name: str, kind: str
) -> None:
    make, x_shape = MODELS[model_name]
    model = make()
    data = _data(kind, x_shape, 3)
    loss = supervised_loss_of_output(CRITERIA[kind]())
    op = GGNOperator(model, data, supervised_forward, loss, mc_samples=2, seed=4)
    exact = diagonal(op, method="exact").estimate
    torch.testing.assert_close(exact, op.to_dense().diagonal(), rtol=1e-10, atol=1e-13)
    # another seed is another matrix: the draws matter
    other = GGNOperator(model, data, supervised_forward, loss, mc_samples=2, seed=5)
    assert not torch.allclose(diagonal(other, method="exact").estimate, exact)


def test_mc_cross_entropy_over_positions() -> None:
    model = nn.Conv1d(2, 4, 3, padding=1).double()
    g = torch.Generator().manual_seed(6)
    X = torch.randn(5, 2, 6, generator=g, dtype=torch.float64)
    data = [
        (X[:3], torch.randint(0, 4, (3, 6), generator=g)),
        (X[3:], torch.randint(0, 4, (2, 6), generator=g)),
    ]
    op = GGNOperator(model, data, supervised_forward, CrossEntropyOutputLoss(), mc_samples=3)
    torch.testing.assert_close(
        diagonal(op, method="exact").estimate, op.to_dense().diagonal(), rtol=1e-10, atol=1e-13
    )


@pytest.mark.parametrize("kind", ["ce", "mse"])
def test_empirical_fisher_diagonal_is_the_mean_squared_per_sample_gradient(kind: str) -> None:
    model = ConvNet().double()
    data = _data(kind, (2, 4, 4), 3)
    per_sample = supervised_per_sample_loss(CRITERIA[kind]())
    op = EmpiricalFisherOperator(model, data, per_sample, param_filter=["conv.*"])
    ref = dense_empirical_fisher(
        model, data, per_sample, select_parameters(model, ["conv.*"])
    ).diagonal()
    torch.testing.assert_close(diagonal(op, method="exact").estimate, ref, rtol=1e-10, atol=1e-13)


def test_refusals_name_the_way_out() -> None:
    model = mlp(5, 6, 3)
    data = _data("ce", (5,), 3)
    autograd_loss = supervised_loss_of_output(lambda o, y: nn.functional.cross_entropy(o, y))
    op = GGNOperator(model, data, supervised_forward, autograd_loss, loss_hvp="autograd")
    with pytest.raises(TypeError, match="hessian_sqrt"):
        diagonal(op, method="exact")
    ggn = GGNOperator(model, data, supervised_forward, CrossEntropyOutputLoss())
    with pytest.raises(TypeError, match="method='exact' needs"):
        diagonal(ggn * 2.0, method="exact")
    ggn.exact_diagonal_max_outputs = 2
    with pytest.raises(ValueError, match="exact_diagonal_max_outputs=2"):
        diagonal(ggn, method="exact")
    bn = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3)).double()
    with pytest.raises(ValueError, match="BatchNorm"):
        diagonal(
            GGNOperator(bn, data, supervised_forward, CrossEntropyOutputLoss()), method="exact"
        )
    drop = nn.Sequential(nn.Linear(5, 3), nn.Dropout(0.5)).double()
    with pytest.raises(ValueError, match=r"model\.eval"):
        diagonal(GGNOperator(drop, data, supervised_forward, CrossEntropyOutputLoss()), method="exact")
    bn.eval()  # running statistics: samples independent again
    op = GGNOperator(bn, data, supervised_forward, CrossEntropyOutputLoss())
    torch.testing.assert_close(
        diagonal(op, method="exact").estimate, op.to_dense().diagonal(), rtol=1e-10, atol=1e-13
    )


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated")
@pytest.mark.parametrize("kind", CRITERIA)
def test_matches_curvlinops_ggn_diagonal(kind: str) -> None:
    curvlinops = pytest.importorskip("curvlinops")
    model = ConvNet().double()
    data = _data(kind, (2, 4, 4), 3)
    criterion = CRITERIA[kind]()
    op = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(criterion))
    # curvlinops 3.0.1 has no GGN diagonal operator: the diagonal of its dense GGN
    theirs = curvlinops.GGNLinearOperator(model, criterion, list(model.parameters()), data)
    dense = theirs @ torch.eye(op.size, dtype=torch.float64)
    torch.testing.assert_close(
        diagonal(op, method="exact").estimate, dense.diagonal(), rtol=1e-10, atol=1e-13
    )
