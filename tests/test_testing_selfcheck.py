"""``testing.check_operator``: catches a non-symmetric operator and engines that disagree,
passes on correct operators, and leaves the operator's own engine in place."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hessian_eigenthings import HessianOperator, LambdaOperator
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.testing import OperatorCheck, check_operator


def _matrix(symmetric: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    M = torch.randn(9, 9, generator=g, dtype=torch.float64)
    return M + M.T if symmetric else M


def test_a_non_symmetric_operator_fails() -> None:
    M = _matrix(symmetric=False)
    report = check_operator(LambdaOperator(lambda v: M @ v, 9, dtype=torch.float64))
    assert not report.passed
    assert report.symmetry_error > 0.05
    assert report.engines == () and report.engine_errors == {}


def test_a_nearly_symmetric_operator_fails_at_its_dtype_threshold() -> None:
    M = _matrix(symmetric=True)
    M[0, 1] += 1e-4
    report = check_operator(LambdaOperator(lambda v: M @ v, 9, dtype=torch.float64))
    assert not report.passed and 1e-7 < report.symmetry_error < 1e-3


def test_a_symmetric_operator_passes_and_the_report_is_frozen() -> None:
    M = _matrix(symmetric=True)
    report = check_operator(LambdaOperator(lambda v: M @ v, 9, dtype=torch.float64), num_vectors=3)
    assert report.passed and report.symmetry_error < 1e-14 and report.num_vectors == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.tolerance = 1.0  # type: ignore[misc]
    assert isinstance(report, OperatorCheck)


def _hessian(model: nn.Module, **kw: object) -> HessianOperator:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 6, (4, 3), generator=g)
    y = torch.randint(0, 4, (4,), generator=g)
    return HessianOperator(model, [(x, y)], supervised_loss(nn.CrossEntropyLoss()), **kw)  # type: ignore[arg-type]


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 3, padding_idx=0)
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.emb(x)).mean(1))


def test_a_data_operator_is_compared_across_engines_and_keeps_its_engine() -> None:
    op = _hessian(_Tokens().double(), engine="autograd")
    report = check_operator(op)
    assert report.engines == ("autograd", "functional")
    assert set(report.engine_errors) == {"functional"}
    assert report.passed, report
    assert op.engine == "autograd"


def test_engines_that_disagree_fail() -> None:
    op = _hessian(_Tokens().double(), engine="functional")
    plain = LambdaOperator(lambda v: v, op.size, dtype=torch.float64)

    class Wrong(type(op)):  # type: ignore[misc]
        def _products(self, V: torch.Tensor) -> torch.Tensor:
            out = super()._products(V)
            return out + V if self.engine == "functional" else out

    op.__class__ = Wrong
    report = check_operator(op, engines=("autograd", "functional"))
    assert not report.passed and report.engine_errors["functional"] > 0.01
    with pytest.raises(ValueError, match="no engines"):
        check_operator(plain, engines=("autograd",))


def test_float32_operator_passes_at_its_threshold() -> None:
    report = check_operator(_hessian(_Tokens()))
    assert report.tolerance == 1e-3 and report.passed, report


def test_an_engine_torch_cannot_run_is_reported_as_skipped() -> None:
    # EmbeddingBag has no forward-mode rule in torch: the functional engine cannot run it
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.EmbeddingBag(6, 3, padding_idx=0)
            self.lin = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.tanh(self.emb(x)))

    from hessian_eigenthings import GGNOperator
    from hessian_eigenthings.loss_fns import supervised_forward, supervised_loss_of_output

    x, y = torch.tensor([[0, 1, 2], [3, 0, 0]]), torch.tensor([0, 1])
    op = GGNOperator(
        Bag().double(),
        [(x, y)],
        supervised_forward,
        supervised_loss_of_output(nn.CrossEntropyLoss()),
        engine="autograd",
    )
    report = check_operator(op)
    assert report.engines == ("autograd",) and "functional" in report.skipped_engines
    assert report.passed, report
