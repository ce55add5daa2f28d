"""KFAC and EKFAC against curvlinops 3's ``KFACLinearOperator`` / ``EKFACLinearOperator`` on the
same model, data (two batches, the last one shorter) and loss, in float64.

The definitions agree for type-2 and the empirical Fisher, expand and reduce, a bias in its own
block or joined to the weight: products agree to ~1e-12. The Monte-Carlo variants draw their
targets from different generators, so only their expectation could be compared (our own tests
check that against type-2). EKFAC in a rank-deficient factor's null space has no unique eigenbasis
(its corrected eigenvalues depend on the basis chosen there), so the reduce cases use more samples
than the conv layers' input dimensions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings import EKFACOperator, KFACOperator
from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

curvlinops = pytest.importorskip("curvlinops")


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)
    ).double()


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 3),
    ).double()


def _data(model: str, criterion: nn.Module, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    X = (
        torch.randn(n, 4, dtype=torch.float64)
        if model == "mlp"
        else torch.randn(n, 2, 6, 6, dtype=torch.float64)
    )
    if isinstance(criterion, nn.CrossEntropyLoss):
        y = torch.randint(0, 3, (n,))
    elif isinstance(criterion, nn.BCEWithLogitsLoss):
        y = (torch.rand(n, 3, dtype=torch.float64) > 0.5).double()
    else:
        y = torch.randn(n, 3, dtype=torch.float64)
    split = (n + 1) // 2 + 1
    return [(X[:split], y[:split]), (X[split:], y[split:])]


def _dense(op: object, n: int) -> torch.Tensor:
    return op @ torch.eye(n, dtype=torch.float64)  # type: ignore[operator]


CRITERIA = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss, "bce": nn.BCEWithLogitsLoss}


# (model, kfac_approx, loss, fisher_type, separate bias): every loss and Fisher type on the MLP,
# a spread of them on the CNN with each approximation, each bias treatment at least twice
CASES = [
    ("mlp", "expand", loss, fisher, separate)
    for loss in ("ce", "mse", "bce")
    for fisher, separate in (("type2", True), ("empirical", False))
] + [
    ("mlp", "expand", "ce", "type2", False),
    ("cnn", "expand", "ce", "type2", True),
    ("cnn", "expand", "mse", "empirical", False),
    ("cnn", "expand", "bce", "type2", False),
    ("cnn", "reduce", "ce", "type2", False),
    ("cnn", "reduce", "mse", "empirical", True),
    ("cnn", "reduce", "mse", "type2", True),
]


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
@pytest.mark.parametrize(("model", "approx", "loss", "fisher_type", "separate"), CASES)
def test_products_agree_with_curvlinops(
    model: str, approx: str, loss: str, fisher_type: str, separate: bool, ekfac: bool
) -> None:
    net = _mlp() if model == "mlp" else _cnn()
    criterion = CRITERIA[loss]()
    data = _data(model, criterion, 24 if approx == "reduce" else 7)
    ours_cls, ref_cls = (
        (EKFACOperator, curvlinops.EKFACLinearOperator)
        if ekfac
        else (KFACOperator, curvlinops.KFACLinearOperator)
    )
    ours = ours_cls(
        net,
        data,
        supervised_forward,
        supervised_loss_of_output(criterion),
        fisher_type=fisher_type,
        kfac_approx=approx,
        separate_bias=separate,
    )
    ref = ref_cls(
        net,
        criterion,
        list(net.parameters()),
        data,
        check_deterministic=False,
        fisher_type={"type2": "type-2"}.get(fisher_type, fisher_type),
        kfac_approx=approx,
        separate_weight_and_bias=separate,
    )
    K, R = ours.to_dense(), _dense(ref, ours.size)
    scale = R.abs().max()
    assert scale > 0
    torch.testing.assert_close(K, R, rtol=0, atol=1e-11 * scale)


@pytest.mark.parametrize("ekfac", [False, True], ids=["kfac", "ekfac"])
def test_matrix_functions_agree_with_curvlinops(ekfac: bool) -> None:
    # smooth and overdetermined (every factor full rank): the log-determinant is not rounding
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    criterion = nn.MSELoss()
    data = _data("mlp", criterion, 20)
    ours_cls, ref_cls = (
        (EKFACOperator, curvlinops.EKFACLinearOperator)
        if ekfac
        else (KFACOperator, curvlinops.KFACLinearOperator)
    )
    ours = ours_cls(net, data, supervised_forward, supervised_loss_of_output(criterion))
    ref = ref_cls(
        net,
        criterion,
        list(net.parameters()),
        data,
        check_deterministic=False,
        fisher_type="type-2",
    )
    torch.testing.assert_close(ours.trace(), ref.trace, rtol=1e-10, atol=0)
    torch.testing.assert_close(ours.frobenius_norm(), ref.frobenius_norm, rtol=1e-10, atol=0)
    torch.testing.assert_close(ours.logdet(), ref.logdet, rtol=1e-8, atol=0)


class _Sequence(nn.Module):
    """Linear layers shared over 6 positions; cross-entropy logits as (N, C, T), MSE as (N, T, C)."""

    def __init__(self, classes_first: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.classes_first = classes_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        return out.permute(0, 2, 1) if self.classes_first else out


@pytest.mark.parametrize("fisher_type", ["type2", "empirical"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("loss", ["ce", "mse"])
def test_sequence_outputs_agree_with_curvlinops(loss: str, approx: str, fisher_type: str) -> None:
    # curvlinops' EKFAC takes 2d outputs only: KFAC here
    net = _Sequence(classes_first=loss == "ce").double()
    X = torch.randn(9, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (9, 6)) if loss == "ce" else torch.randn(9, 6, 3, dtype=torch.float64)
    data = [(X[:5], y[:5]), (X[5:], y[5:])]
    criterion = CRITERIA[loss]()
    ours = KFACOperator(
        net,
        data,
        supervised_forward,
        supervised_loss_of_output(criterion),
        fisher_type=fisher_type,
        kfac_approx=approx,
    )
    ref = curvlinops.KFACLinearOperator(
        net,
        criterion,
        list(net.parameters()),
        data,
        check_deterministic=False,
        fisher_type={"type2": "type-2"}.get(fisher_type, fisher_type),
        kfac_approx=approx,
    )
    R = _dense(ref, ours.size)
    torch.testing.assert_close(ours.to_dense(), R, rtol=0, atol=1e-11 * R.abs().max())
