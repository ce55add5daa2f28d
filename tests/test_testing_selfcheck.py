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


def test_dense_hessian_of_a_tied_gpt2_with_every_parameter() -> None:
    """``testing.dense_hessian`` on HF GPT-2 with every parameter selected (tied embedding and
    head, LayerNorm weights at one): its LayerNorm-weight rows were 30-50% off when it took
    torch.func.jacrev twice; the autograd engine's products are the independent reference."""
    transformers = pytest.importorskip("transformers")
    from hessian_eigenthings.testing import dense_hessian

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=4, n_head=1, vocab_size=7, n_positions=8,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
    model = model.double().eval()
    ids = torch.randint(0, 7, (2, 5))
    batch = {"input_ids": ids, "labels": ids}

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return m(**b).loss

    H = dense_hessian(model, [batch], loss, list(model.named_parameters()))
    A = HessianOperator(model, [batch], loss, engine="autograd").to_dense()
    # HF's eager attention takes its softmax in float32: agreement to that rounding
    assert float((H - A).norm() / A.norm()) < 1e-7
