"""Warnings and errors say what fits the run (issue 15, items 8 and 19)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hessian_eigenthings import ConvergenceWarning, RandomForwardWarning
from hessian_eigenthings.algorithms import lanczos
from hessian_eigenthings.algorithms.lanczos import check_symmetry
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator, LambdaOperator

SUP = supervised_loss(nn.CrossEntropyLoss())


def dropout_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 3)).double()


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,)))]


def test_dropout_in_training_mode_warns_once_at_the_users_line() -> None:
    model = dropout_model().train()
    op = HessianOperator(model, data(), SUP, graph_reuse=False)
    v = torch.randn(op.size, dtype=torch.float64)
    with pytest.warns(RandomForwardWarning, match="model.eval") as rec:
        op @ v
        op @ v
    assert len([w for w in rec if w.category is RandomForwardWarning]) == 1
    assert rec[0].filename == __file__


def test_no_warning_in_eval_mode() -> None:
    model = dropout_model().eval()
    op = HessianOperator(model, data(), SUP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op @ torch.randn(op.size, dtype=torch.float64)


def test_random_forward_is_named_as_a_cause_and_asymmetry_message_fits() -> None:
    op = HessianOperator(dropout_model().train(), data(), SUP)
    assert any("model.eval()" in c for c in op.inconsistency_causes())
    m = torch.randn(6, 6, dtype=torch.float64)  # not symmetric
    bare = LambdaOperator(lambda v: m @ v, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="missing transpose") as exc:
        check_symmetry(bare, seed=0)
    assert "TF32" not in str(exc.value)


def test_causes_fit_the_operator() -> None:
    model = nn.Sequential(nn.Linear(5, 3)).double()
    fd = HessianOperator(model, data(), SUP, method="finite_difference")
    assert any("finite differences" in c for c in fd.inconsistency_causes())
    assert not any("TF32" in c for c in fd.inconsistency_causes())
    tf32 = HessianOperator(model, data(), SUP, precision="tf32")
    assert any("tf32" in c for c in tf32.inconsistency_causes())
    cycling = HessianOperator(model, data(), SUP, full_dataset=False)
    assert any("full_dataset=False" in c for c in cycling.inconsistency_causes())
    assert HessianOperator(model, data(), SUP).inconsistency_causes() == []


class NoisyOperator(LambdaOperator):
    """A diagonal matrix whose products carry relative noise 1e-7: the Lanczos estimates converge
    to tol=1e-10, the recomputed residuals cannot."""

    def inconsistency_causes(self) -> list[str]:
        return ["the test's injected noise"]


def test_convergence_warning_quotes_the_operators_causes() -> None:
    d = torch.linspace(1.0, 2.0, 40, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)

    def noisy(v: torch.Tensor) -> torch.Tensor:
        out = d * v
        return out + 1e-7 * out.norm() * torch.randn(out.shape, generator=gen, dtype=out.dtype) / 40**0.5

    op = NoisyOperator(noisy, 40, dtype=torch.float64)
    with pytest.warns(ConvergenceWarning) as rec:
        lanczos(op, k=2, tol=1e-10, seed=0, max_iter=200)
    text = str(rec[0].message)
    assert "TF32" not in text
    assert "recomputed residuals" in text and "the test's injected noise" in text
