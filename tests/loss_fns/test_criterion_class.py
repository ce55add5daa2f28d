"""A criterion class where an instance is meant (``supervised_loss(nn.CrossEntropyLoss)``) is refused
where it is passed, with the fix, instead of failing deep inside the first product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import (
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.checks import check_criterion
from tests.conftest import classification_data, mlp

HELPERS = [supervised_loss, supervised_loss_of_output, supervised_per_sample_loss]


@pytest.mark.parametrize("helper", HELPERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("cls", [nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss])
def test_helpers_refuse_a_criterion_class(helper: object, cls: type) -> None:
    with pytest.raises(TypeError, match=rf"pass an instance: nn\.{cls.__name__}\(\)"):
        helper(cls)  # type: ignore[operator]


def test_a_user_class_is_refused_too() -> None:
    class MyLoss:
        def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return out.sum()

    with pytest.raises(TypeError, match=r"pass an instance: MyLoss\(\)"):
        supervised_loss(MyLoss)  # type: ignore[arg-type]
    supervised_loss(MyLoss())  # an instance is fine


def test_instances_and_functions_still_accepted() -> None:
    data = classification_data()
    model = mlp()
    for crit in (
        nn.CrossEntropyLoss(),
        torch.nn.functional.cross_entropy,
        lambda o, y: o.pow(2).mean(),
    ):
        loss = supervised_loss(crit)
        assert loss(model, data[0]).dim() == 0


def test_check_criterion_is_the_one_check() -> None:
    with pytest.raises(TypeError, match=r"pass an instance: nn\.CrossEntropyLoss\(\)"):
        check_criterion(nn.CrossEntropyLoss)
    with pytest.raises(TypeError, match="criterion must be callable"):
        check_criterion(3)
    check_criterion(nn.CrossEntropyLoss())


def test_operator_refuses_a_criterion_class_as_loss_fn() -> None:
    """The 0.x habit with the class: the operator names the helper and the instance."""
    with pytest.raises(TypeError, match=r"supervised_loss\(nn\.CrossEntropyLoss\(\)\)"):
        he.HessianOperator(mlp(), classification_data(), nn.CrossEntropyLoss)  # type: ignore[arg-type]
