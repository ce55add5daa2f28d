"""A criterion or an uncalled helper passed as the loss is refused when the operator is built,
with the line to write instead (issue 15, item 10)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.operators import EmpiricalFisherOperator, GGNOperator, HessianOperator


def setup() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(nn.Linear(4, 3)).double()
    return model, [(torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))]


def test_criterion_as_loss_fn_names_the_wrapper() -> None:
    model, data = setup()
    with pytest.raises(TypeError, match=r"supervised_loss\(nn.CrossEntropyLoss\(\)\)"):
        HessianOperator(model, data, nn.CrossEntropyLoss())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"supervised_per_sample_loss\(nn.CrossEntropyLoss\(\)\)"):
        EmpiricalFisherOperator(model, data, nn.CrossEntropyLoss())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"supervised_loss_of_output\(nn.MSELoss\(\)\)"):
        GGNOperator(model, data, he.supervised_forward, nn.MSELoss(), loss_hvp="autograd")  # type: ignore[arg-type]


def test_uncalled_helpers_are_caught() -> None:
    model, data = setup()
    with pytest.raises(TypeError, match=r"loss_fn=hf_lm_loss\(\)"):
        HessianOperator(model, data, he.hf_lm_loss)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"supervised_loss\(nn.CrossEntropyLoss\(\)\)"):
        HessianOperator(model, data, he.supervised_loss)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"forward_fn=hf_lm_forward\(\)"):
        GGNOperator(model, data, he.hf_lm_forward, he.hf_lm_loss_of_output())  # type: ignore[arg-type]


def test_the_right_forms_still_work() -> None:
    model, data = setup()
    v = torch.randn(15, dtype=torch.float64)
    HessianOperator(model, data, he.supervised_loss(nn.CrossEntropyLoss())) @ v
    EmpiricalFisherOperator(model, data, he.supervised_per_sample_loss(nn.CrossEntropyLoss())) @ v
