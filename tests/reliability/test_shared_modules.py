"""A module object registered under two names (``nn.Sequential(blk, blk)``,
``nn.ModuleList([blk] * 2)``): every operator and engine leaves the model exactly as it found
it (the same Parameter objects, values, ``requires_grad`` and ``.grad``) and equals a dense
float64 oracle written out by hand for the shared block (NOTE [each slot once])."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators import (
    CurvatureOperator,
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
)
from hessian_eigenthings.param_utils import select_parameters
from hessian_eigenthings.testing import dense_hessian

CE = nn.CrossEntropyLoss()
D = 3  # width of the shared block
N = 5  # samples


class Twice(nn.Module):
    """The block in a ModuleList twice."""

    def __init__(self, blk: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([blk] * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(kind: str) -> tuple[nn.Module, nn.Linear]:
    torch.manual_seed(0)
    blk = nn.Sequential(nn.Linear(D, D), nn.Tanh()).double()
    model = nn.Sequential(*[blk] * 2) if kind == "sequential" else Twice(blk)
    return model, blk[0]  # type: ignore[return-value]


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(N, D, generator=gen, dtype=torch.float64), torch.randint(0, D, (N,), generator=gen))]


def net(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The model as a function of the shared block's (weight, bias), written out."""
    w, b = theta[: D * D].view(D, D), theta[D * D :]
    for _ in range(2):
        x = torch.tanh(x @ w.T + b)
    return x


def oracles(lin: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    theta = torch.cat([lin.weight.detach().reshape(-1), lin.bias.detach()])
    hessian = torch.func.hessian(lambda t: F.cross_entropy(net(t, x), y))(theta)
    out = net(theta, x)
    J = torch.func.jacrev(lambda t: net(t, x).reshape(-1))(theta)
    H_out = torch.func.hessian(lambda o: F.cross_entropy(o.view(N, D), y))(out.reshape(-1))
    # per-sample gradients g_i, one autograd call each
    grads = []
    for i in range(N):
        t = theta.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(net(t, x[i : i + 1]), y[i : i + 1]), t)
        grads.append(g)
    G = torch.stack(grads)
    return {"hessian": hessian, "ggn": J.T @ H_out @ J, "fisher": G.T @ G / N}


def snapshot(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor, bool, torch.Tensor | None, torch.Tensor | None]]:
    return [
        (name, p, p.detach().clone(), p.requires_grad, p.grad, None if p.grad is None else p.grad.clone())
        for name, p in model.named_parameters(remove_duplicate=False)
    ]


def assert_as_found(model: nn.Module, before: list) -> None:  # type: ignore[type-arg]
    after = dict(model.named_parameters(remove_duplicate=False))
    assert list(after) == [name for name, *_ in before]
    for name, p, value, requires_grad, grad, grad_value in before:
        now = after[name]
        assert now is p and type(now) is nn.Parameter, f"{name} is no longer the model's Parameter"
        assert torch.equal(now, value) and now.requires_grad == requires_grad
        assert now.grad is grad and (grad is None or torch.equal(now.grad, grad_value))


LOSS = supervised_loss(CE)
MAKERS: dict[str, tuple[str, Callable[..., CurvatureOperator]]] = {
    "hessian": ("hessian", lambda m, d, e: HessianOperator(m, d, LOSS, engine=e)),
    "hessian-fd": ("hessian", lambda m, d, e: HessianOperator(m, d, LOSS, method="finite_difference")),
    "ggn": ("ggn", lambda m, d, e: GGNOperator(m, d, supervised_forward, supervised_loss_of_output(CE), engine=e)),
    "ggn-jvp-fd": (
        "ggn",
        lambda m, d, e: GGNOperator(m, d, supervised_forward, supervised_loss_of_output(CE), jvp="finite_difference"),
    ),
    "fisher": ("fisher", lambda m, d, e: EmpiricalFisherOperator(m, d, supervised_per_sample_loss(CE), engine=e)),
}
CASES = [
    (name, engine)
    for name in MAKERS
    for engine in (["autograd", "functional"] if name in ("hessian", "ggn", "fisher") else ["autograd"])
]


@pytest.mark.parametrize("kind", ["sequential", "module_list"])
@pytest.mark.parametrize(("name", "engine"), CASES)
def test_products_leave_the_model_as_found(kind: str, name: str, engine: str) -> None:
    model, lin = build(kind)
    lin.weight.grad = torch.full_like(lin.weight, 0.5)  # a pending gradient must survive
    batches = data()
    which, make = MAKERS[name]
    dense = oracles(lin, *batches[0])[which]
    before = snapshot(model)
    op = make(model, batches, engine)
    assert op.size == D * D + D  # the shared block counted once
    exact = "fd" not in name
    tol = {"rtol": 1e-10, "atol": 1e-12} if exact else {"rtol": 1e-6, "atol": 1e-8}
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(op.size, generator=gen, dtype=torch.float64)
    V = torch.randn(op.size, 3, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(op @ v, dense @ v, **tol)
    torch.testing.assert_close(op @ V, dense @ V, **tol)  # a block, on a kept state where one is kept
    torch.testing.assert_close(op @ v, dense @ v, **tol)
    assert_as_found(model, before)
    # and the model still trains: its parameters are leaves that collect gradients
    F.cross_entropy(model(batches[0][0]), batches[0][1]).backward()
    assert lin.weight.grad is before[0][4] and not torch.equal(lin.weight.grad, before[0][5])


@pytest.mark.parametrize("kind", ["sequential", "module_list"])
def test_the_dense_oracle_leaves_the_model_as_found(kind: str) -> None:
    model, lin = build(kind)
    batches = data()
    before = snapshot(model)
    H = dense_hessian(model, batches, LOSS, select_parameters(model))
    torch.testing.assert_close(H, oracles(lin, *batches[0])["hessian"], rtol=1e-10, atol=1e-12)
    assert_as_found(model, before)
