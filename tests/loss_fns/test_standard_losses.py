"""Supervised loss helpers: closed-form output Hessians equal torch.func Hessians; dispatch; per-sample losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    CrossEntropyOutputLoss,
    MSEOutputLoss,
    OutputHessianLoss,
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)


def check_hvp(loss: OutputHessianLoss, output: torch.Tensor, batch: object, k: int = 3) -> None:
    H = torch.func.jacrev(torch.func.jacrev(lambda o: loss(o, batch)))(output)
    H = H.reshape(output.numel(), output.numel())
    U = torch.randn(k, *output.shape, dtype=output.dtype)
    got = loss.hvp(output, batch, U)
    assert got.shape == U.shape
    torch.testing.assert_close(got.reshape(k, -1), U.reshape(k, -1) @ H.T, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_class_indices_with_ignore_index(
    reduction: str, label_smoothing: float
) -> None:
    logits = torch.randn(9, 7, dtype=torch.float64)
    y = torch.randint(0, 7, (9,))
    y[[1, 4]] = -100
    loss = cross_entropy_loss_of_output(
        reduction=reduction, label_smoothing=label_smoothing, impl="eager"
    )  # type: ignore[arg-type]
    check_hvp(loss, logits, (None, y))
    torch.testing.assert_close(
        loss(logits, (None, y)),
        nn.functional.cross_entropy(
            logits, y, reduction=reduction, label_smoothing=label_smoothing
        ),
    )


def test_cross_entropy_batchmean_sums_each_sample_and_averages_over_samples() -> None:
    logits = torch.randn(3, 5, 4, dtype=torch.float64)  # (N, C, positions)
    y = torch.randint(0, 5, (3, 4))
    y[0, 1] = -100
    loss = cross_entropy_loss_of_output(reduction="batchmean", impl="eager")
    expected = nn.functional.cross_entropy(logits, y, reduction="sum") / 3
    torch.testing.assert_close(loss(logits, (None, y)), expected)
    check_hvp(loss, logits, (None, y))
    with pytest.raises(ValueError, match="'mean', 'sum' or 'batchmean'"):
        cross_entropy_loss_of_output(reduction="none")  # type: ignore[arg-type]


def test_cross_entropy_spatial_and_probability_targets() -> None:
    logits = torch.randn(3, 5, 4, 2, dtype=torch.float64)  # (N, C, d1, d2)
    y = torch.randint(0, 5, (3, 4, 2))
    y[0, 1, 1] = 7  # ignore_index=7
    check_hvp(cross_entropy_loss_of_output(ignore_index=7), logits, (None, y))
    probs = torch.softmax(torch.randn(3, 5, 4, 2, dtype=torch.float64), dim=1)
    check_hvp(cross_entropy_loss_of_output(), logits, (None, probs))
    check_hvp(
        cross_entropy_loss_of_output(), torch.randn(6, dtype=torch.float64), (None, torch.tensor(2))
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse(reduction: str) -> None:
    out = torch.randn(4, 3, dtype=torch.float64)
    y = torch.randn(4, 3, dtype=torch.float64)
    check_hvp(mse_loss_of_output(reduction=reduction), out, (None, y))  # type: ignore[arg-type]


def test_supervised_loss_of_output_dispatch() -> None:
    ce = supervised_loss_of_output(nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1))
    assert isinstance(ce, CrossEntropyOutputLoss) and isinstance(ce, OutputHessianLoss)
    assert ce.ignore_index == 3 and ce.label_smoothing == 0.1
    assert isinstance(supervised_loss_of_output(nn.MSELoss(reduction="sum")), MSEOutputLoss)
    for criterion in (
        nn.CrossEntropyLoss(weight=torch.ones(3)),
        nn.HuberLoss(),
        nn.MSELoss(reduction="none"),
    ):
        generic = supervised_loss_of_output(criterion)
        assert not isinstance(generic, OutputHessianLoss)
    out, y = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(
        supervised_loss_of_output(nn.HuberLoss())(out, (None, y)), nn.HuberLoss()(out, y)
    )
    with pytest.raises(TypeError):
        supervised_loss_of_output("ce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy_loss_of_output(reduction="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fused"):
        cross_entropy_loss_of_output(impl="cuda")  # type: ignore[arg-type]


def test_supervised_loss_and_forward() -> None:
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    torch.testing.assert_close(supervised_forward(model, (x, y)), model(x))
    torch.testing.assert_close(
        supervised_loss(nn.CrossEntropyLoss())(model, (x, y)),
        nn.functional.cross_entropy(model(x), y),
    )
    with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
        supervised_forward(model, x)


@pytest.mark.parametrize(
    "criterion, target",
    [
        (nn.CrossEntropyLoss(), lambda: torch.randint(0, 2, (5,))),
        (nn.MSELoss(), lambda: torch.randn(5, 2)),
        (nn.MSELoss(reduction="sum"), lambda: torch.randn(5, 2)),
    ],
)
def test_per_sample_losses_are_the_criterion_on_each_sample(criterion: nn.Module, target) -> None:  # type: ignore[no-untyped-def]
    model = nn.Linear(3, 2)
    x, y = torch.randn(5, 3), target()
    per = supervised_per_sample_loss(criterion)(model, (x, y))
    assert per.shape == (5,)
    expected = torch.stack([criterion(model(x[i : i + 1]), y[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(per, expected)
    assert criterion.reduction != "none"  # the user's criterion is not modified
    mapped = supervised_per_sample_loss(lambda o, t: criterion(o, t))(model, (x, y))
    torch.testing.assert_close(mapped, expected)
