"""One operator, one dataset: one-shot iterables and bad batch counts are refused up front
(issue 15, items 4, 5 and the num_batches part of 7)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian

SUP = supervised_loss(nn.CrossEntropyLoss())


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))) for _ in range(4)]


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 3)).double()


@pytest.mark.parametrize("num_batches", [None, 2])
def test_a_generator_is_refused_with_what_to_pass(num_batches: int | None) -> None:
    data = batches()
    with pytest.raises(TypeError, match=r"list\(your_generator\)"):
        HessianOperator(model(), (b for b in data), SUP, num_batches=num_batches)
    with pytest.raises(TypeError, match="one-shot iterator"):
        HessianOperator(model(), iter(data), SUP)


def test_num_batches_means_the_same_first_batches_every_product() -> None:
    m, data = model(), batches()
    op = HessianOperator(m, data, SUP, num_batches=2, graph_reuse=False)
    H = dense_hessian(m, data[:2], SUP, select_parameters(m))
    v = torch.randn(op.size, dtype=torch.float64)
    for _ in range(4):
        torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", [2.5, True, 0, "2"])
def test_num_batches_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="num_batches must be an int"):
        HessianOperator(model(), batches(), SUP, num_batches=bad)  # type: ignore[arg-type]
