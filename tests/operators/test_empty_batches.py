"""Batches of zero samples: no weight at all is a clear ``ValueError``; among other batches they
contribute nothing, and the operator says once that it skipped them (``EmptyBatchWarning``).
Oracle: the dense float64 curvature of the non-empty batches."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hessian_eigenthings import (
    EKFACOperator,
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
    KFACOperator,
    KFOCOperator,
)
from hessian_eigenthings._warnings import EmptyBatchWarning
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.testing import dense_hessian

CE = nn.CrossEntropyLoss()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def _make(kind: str, model: nn.Module, data: list, **kw: object) -> object:  # type: ignore[type-arg]
    if kind == "hessian":
        return HessianOperator(model, data, supervised_loss(CE), **kw)  # type: ignore[arg-type]
    if kind == "ggn":
        return GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE), **kw)  # type: ignore[arg-type]
    return EmpiricalFisherOperator(model, data, supervised_per_sample_loss(CE), **kw)  # type: ignore[arg-type]


KINDS = ["hessian", "ggn", "fisher"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batches", [1, 3])
def test_only_empty_batches_is_a_clear_error(kind: str, batches: int) -> None:
    model = _model()
    op = _make(kind, model, [_batch(0)] * batches, engine="autograd")
    v = torch.ones(op.size, dtype=torch.float64)  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptyBatchWarning)
        with pytest.raises(ValueError, match="zero samples"):
            op @ v  # type: ignore[operator]


@pytest.mark.parametrize("engine", ["autograd", "functional"])
@pytest.mark.parametrize("kind", KINDS)
def test_empty_batches_among_others_are_skipped_once_said(kind: str, engine: str) -> None:
    model = _model()
    full = [_batch(3, 1), _batch(2, 2)]
    data = [_batch(0), full[0], _batch(0), full[1]]
    op = _make(kind, model, data, engine=engine)
    ref = _make(kind, model, full, engine="autograd")
    eye = torch.eye(op.size, dtype=torch.float64)  # type: ignore[attr-defined]
    with pytest.warns(EmptyBatchWarning, match="2 of 4 batches") as rec:
        A = op @ eye  # type: ignore[operator]
    assert len(rec) == 1 and rec[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        A2 = op @ eye  # type: ignore[operator]  (said once per operator)
    torch.testing.assert_close(A, ref @ eye, rtol=1e-10, atol=1e-12)  # type: ignore[operator]
    torch.testing.assert_close(A2, A, rtol=1e-10, atol=1e-12)
    if kind == "hessian":
        dense = dense_hessian(model, full, supervised_loss(CE), list(model.named_parameters()))
        torch.testing.assert_close(A, dense, rtol=1e-9, atol=1e-11)


def test_uniform_weighting_skips_empty_batches() -> None:
    model = _model()
    full = [_batch(3, 1), _batch(2, 2)]
    op = HessianOperator(
        model, [full[0], _batch(0), full[1]], supervised_loss(CE), engine="autograd"
    )
    op.batch_weighting = "uniform"
    ref = dense_hessian(model, [full[0]], supervised_loss(CE), list(model.named_parameters())) / 2
    ref = (
        ref
        + dense_hessian(model, [full[1]], supervised_loss(CE), list(model.named_parameters())) / 2
    )
    with pytest.warns(EmptyBatchWarning):
        A = op.to_dense()
    torch.testing.assert_close(A, ref, rtol=1e-9, atol=1e-11)


def test_cycling_skips_to_the_next_nonempty_batch() -> None:
    model = _model()
    full = _batch(3, 1)
    op = HessianOperator(
        model, [_batch(0), full], supervised_loss(CE), full_dataset=False, engine="autograd"
    )
    ref = dense_hessian(model, [full], supervised_loss(CE), list(model.named_parameters()))
    v = torch.randn(op.size, dtype=torch.float64)
    with pytest.warns(EmptyBatchWarning):
        torch.testing.assert_close(op @ v, ref @ v, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(op @ v, ref @ v, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("cls", [KFACOperator, EKFACOperator, KFOCOperator])
def test_kronecker_factors_skip_empty_batches(cls: type) -> None:
    model = _model()
    full = [_batch(3, 1), _batch(2, 2)]
    lo = supervised_loss_of_output(CE)
    ref = cls(model, full, supervised_forward, lo).to_dense()
    with pytest.warns(EmptyBatchWarning, match="2 of 4 batches") as rec:
        op = cls(model, [_batch(0), full[0], _batch(0), full[1]], supervised_forward, lo)
    assert len(rec) == 1 and rec[0].filename == __file__
    torch.testing.assert_close(op.to_dense(), ref, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="zero samples"):
        cls(model, [_batch(0)] * 2, supervised_forward, lo)
