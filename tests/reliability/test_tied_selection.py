"""A filter naming a tied weight by its second name selects it (issue 15, item 11)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(7, 4)
        self.body = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.body(self.wte(ids))))


def test_the_head_glob_selects_the_tied_embedding_under_its_registered_name() -> None:
    model = TiedLM().double()
    picked = select_parameters(model, "lm_head.*")
    assert list(picked) == ["wte.weight"] and picked["wte.weight"] is model.lm_head.weight
    data = [(torch.randint(0, 7, (6,)), torch.randint(0, 7, (6,)))]
    loss = supervised_loss(nn.CrossEntropyLoss())
    op = HessianOperator(model, data, loss, param_filter="lm_head.*")
    H = dense_hessian(model, data, loss, select_parameters(model, "wte.*"))
    v = torch.randn(op.size, dtype=torch.float64)
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)


def test_an_empty_selection_lists_the_names_readably() -> None:
    with pytest.raises(ValueError, match=r"are: wte.weight, body.weight, body.bias$"):
        select_parameters(TiedLM(), "nothing.*")
