"""A kept state never answers for a model that changed (issue 15, items 1-3 and 6).

Each case: build an operator, take a product (the state is kept), change something the
product depends on behind the operator's back, take the product again, and compare with
a fresh dense float64 oracle of the changed model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
)
from hessian_eigenthings.operators import GGNOperator, HessianOperator, RandomForwardWarning
from hessian_eigenthings.param_utils import match_names, select_parameters
from hessian_eigenthings.testing import dense_hessian
from tests.operators.curvature_oracles import dense_ggn

CE = nn.CrossEntropyLoss()
SUP = supervised_loss(CE)
ENGINES = ["autograd", "functional"]


class TwoLayer(nn.Module):
    def __init__(self, dropout: float = 0.0, bn: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6) if bn else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.bn(self.a(x)))))


def data(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,)))]


@pytest.mark.parametrize("engine", ENGINES)
def test_unselected_parameter_changed_in_place(engine: str) -> None:
    model, batches = TwoLayer().double(), data()
    flt = match_names("b.*")
    op = HessianOperator(model, batches, SUP, param_filter=flt, engine=engine)  # type: ignore[arg-type]
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v
    with torch.no_grad():
        model.a.weight.mul_(3)
    H = dense_hessian(model, batches, SUP, select_parameters(model, flt))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)


def test_unselected_parameter_replaced_by_a_new_tensor() -> None:
    model, batches = TwoLayer().double(), data()
    flt = match_names("b.*")
    op = HessianOperator(model, batches, SUP, param_filter=flt)
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v
    model.a.weight = nn.Parameter(model.a.weight.detach() * 2)
    H = dense_hessian(model, batches, SUP, select_parameters(model, flt))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("make", ["hessian", "ggn"])
def test_train_eval_switch_is_seen(make: str) -> None:
    model, batches = TwoLayer(dropout=0.5).double(), data()
    if make == "hessian":
        op = HessianOperator(model, batches, SUP)
    else:
        op = GGNOperator(model, batches, supervised_forward, supervised_loss_of_output(CE))
    v = torch.randn(op.size, dtype=torch.float64)
    model.train()
    with pytest.warns(RandomForwardWarning):
        op @ v  # a dropout-masked product, kept
    model.eval()
    names = select_parameters(model)
    if make == "hessian":
        dense = dense_hessian(model, batches, SUP, names)
    else:
        dense = dense_ggn(model, batches, supervised_forward, supervised_loss_of_output(CE), names)
    torch.testing.assert_close(op @ v, dense @ v, rtol=1e-10, atol=1e-12)


def test_eval_mode_buffer_changed_while_another_module_trains() -> None:
    model, batches = TwoLayer(bn=True).double(), data()
    model.train()
    model.bn.eval()  # frozen-BN fine-tuning
    op = HessianOperator(model, batches, SUP)
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v
    with torch.no_grad():
        model.bn.running_var.mul_(4)
    H = dense_hessian(model, batches, SUP, select_parameters(model))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)


def test_precision_switch_invalidates_the_kept_state() -> None:
    model, batches = TwoLayer().double(), data()
    op = HessianOperator(model, batches, SUP, engine="functional")
    op @ torch.randn(op.size, dtype=torch.float64)
    versions = op._states.versions()
    op.precision = "tf32"
    with torch.no_grad():  # the key is read under the product's own precision
        from hessian_eigenthings.operators.precision import product_precision

        with product_precision("tf32"):
            assert op._states.versions() != versions


def test_finite_differences_leave_the_users_pending_graph_valid() -> None:
    model, batches = TwoLayer().double(), data()
    loss = SUP(model, batches[0])
    op = HessianOperator(model, batches, SUP, method="finite_difference")
    versions = [p._version for p in model.parameters()]
    Hv = op @ torch.randn(op.size, dtype=torch.float64)
    assert [p._version for p in model.parameters()] == versions
    loss.backward()  # raised "modified by an inplace operation" before
    assert all(p.grad is not None for p in model.parameters())
    assert torch.isfinite(Hv).all()


def test_finite_differences_match_the_oracle_with_tied_weights() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(4, 4, bias=False)
            self.head = nn.Linear(4, 4, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.emb(x)))

    model = Tied().double()
    batches = [(torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 4, (6,)))]
    op = HessianOperator(model, batches, SUP, method="finite_difference", fd_eps=1e-4)
    H = dense_hessian(model, batches, SUP, select_parameters(model))
    v = torch.randn(op.size, dtype=torch.float64)
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd_fused", "adamw_foreach"])
def test_optimizer_step_that_keeps_versions(engine: str, optimizer: str) -> None:
    """Fused optimizer steps write the parameters without bumping their version counters
    (NOTE [updates that keep the version]); the next product must see the new parameters."""
    model, batches = TwoLayer().double(), data()
    op = HessianOperator(model, batches, SUP, engine=engine)  # type: ignore[arg-type]
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v
    make = {
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
        "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.5, fused=True),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    }[optimizer]
    opt = make(list(model.parameters()))
    versions = [p._version for p in model.parameters()]
    x, y = batches[0]
    opt.zero_grad()
    CE(model(x), y).backward()
    opt.step()
    if optimizer.endswith("fused"):  # the case this guards: nothing in the version counters
        assert [p._version for p in model.parameters()] == versions
    H = dense_hessian(model, batches, SUP, select_parameters(model))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_data_write_is_seen_by_the_next_algorithm(engine: str) -> None:
    """A write through ``.data`` keeps the version counter; every algorithm declares its
    products first (``expect_products``), which compares the parameters' norms."""
    from hessian_eigenthings.algorithms import lanczos

    model, batches = TwoLayer().double(), data()
    op = HessianOperator(model, batches, SUP, engine=engine)  # type: ignore[arg-type]
    v = torch.randn(op.size, dtype=torch.float64)
    op @ v
    assert op.held_bytes >= 0 and len(op._states.entries) == 1
    model.a.weight.data.mul_(2.0)
    H = dense_hessian(model, batches, SUP, select_parameters(model))
    top = lanczos(op, k=2, which="LA", tol=1e-10, seed=0)
    ref = torch.linalg.eigvalsh(H)[-2:].flip(0)
    torch.testing.assert_close(top.eigenvalues, ref, rtol=1e-8, atol=1e-10)
    model.b.bias.data.add_(0.5)  # a bias enters the Hessian through the softmax
    op.expect_products(1)
    H = dense_hessian(model, batches, SUP, select_parameters(model))
    torch.testing.assert_close(op @ v, H @ v, rtol=1e-10, atol=1e-12)
