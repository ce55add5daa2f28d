"""Parameters replaced after the operator was built (``load_state_dict(assign=True)``,
``module.weight = nn.Parameter(...)``, a new submodule): the operator follows the model's
current parameters by name, or raises naming the parameter; never a silent zero block.
Oracles: dense float64 curvature at the new parameters (``hessian_eigenthings.testing``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings import (
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
    lanczos,
)
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.testing import dense_hessian, dense_jacobian

CE = nn.CrossEntropyLoss()


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(6, 4, generator=g, dtype=torch.float64)
    Y = torch.randint(0, 3, (6,), generator=g)
    return [(X[:4], Y[:4]), (X[4:], Y[4:])]


def _hessian(model: nn.Module, data: list) -> torch.Tensor:  # type: ignore[type-arg]
    return dense_hessian(model, data, supervised_loss(CE), list(model.named_parameters()))


def _ggn(model: nn.Module, data: list) -> torch.Tensor:  # type: ignore[type-arg]
    named = list(model.named_parameters())
    acc = torch.zeros(())
    for batch in data:
        J = dense_jacobian(model, batch, supervised_forward, named)
        out = model(batch[0]).detach()
        H = torch.func.jacrev(torch.func.jacrev(lambda o, b=batch: CE(o, b[1])))(out).reshape(
            out.numel(), -1
        )
        acc = acc + len(batch[1]) * (J.T @ H @ J)
    return acc / sum(len(b[1]) for b in data)


def _fisher(model: nn.Module, data: list) -> torch.Tensor:  # type: ignore[type-arg]
    grads = []
    for x, y in data:
        for i in range(len(y)):
            g = torch.autograd.grad(CE(model(x[i : i + 1]), y[i : i + 1]), list(model.parameters()))
            grads.append(torch.cat([t.reshape(-1) for t in g]))
    G = torch.stack(grads)
    return G.T @ G / G.shape[0]


def _make(kind: str, model: nn.Module, data: list) -> object:  # type: ignore[type-arg]
    if kind.startswith("hessian"):
        _, how = kind.split("-")
        if how == "fd":
            return HessianOperator(model, data, supervised_loss(CE), method="finite_difference")
        return HessianOperator(model, data, supervised_loss(CE), engine=how)  # type: ignore[arg-type]
    if kind.startswith("ggn"):
        return GGNOperator(
            model,
            data,
            supervised_forward,
            supervised_loss_of_output(CE),
            engine=kind.split("-")[1],
        )  # type: ignore[arg-type]
    return EmpiricalFisherOperator(
        model, data, supervised_per_sample_loss(CE), engine=kind.split("-")[1]
    )  # type: ignore[arg-type]


KINDS = {
    "hessian-autograd": _hessian,
    "hessian-functional": _hessian,
    "hessian-fd": _hessian,
    "ggn-autograd": _ggn,
    "ggn-functional": _ggn,
    "fisher-autograd": _fisher,
    "fisher-functional": _fisher,
}


def _tol(kind: str) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-6} if kind.endswith("fd") else {"rtol": 1e-9, "atol": 1e-11}


@pytest.mark.parametrize("kind", KINDS)
def test_load_state_dict_assign_is_followed(kind: str) -> None:
    model, data = _model(0), _data()
    op = _make(kind, model, data)
    eye = torch.eye(op.size, dtype=torch.float64)  # type: ignore[attr-defined]
    torch.testing.assert_close(op @ eye, KINDS[kind](model, data), **_tol(kind))  # type: ignore[operator]
    model.load_state_dict(_model(1).state_dict(), assign=True)  # new Parameter objects
    ref = KINDS[kind](model, data)
    torch.testing.assert_close(op @ eye, ref, **_tol(kind))  # type: ignore[operator]
    torch.testing.assert_close(op @ eye[0], ref[0], **_tol(kind))  # type: ignore[operator]


@pytest.mark.parametrize("kind", ["hessian-autograd", "ggn-functional"])
def test_assigned_parameter_and_new_submodule_are_followed(kind: str) -> None:
    model, data = _model(0), _data()
    op = _make(kind, model, data)
    op @ torch.ones(op.size, dtype=torch.float64)  # type: ignore[attr-defined, operator]  (keeps a state)
    model[2].weight = nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
    eye = torch.eye(op.size, dtype=torch.float64)  # type: ignore[attr-defined]
    torch.testing.assert_close(op @ eye, KINDS[kind](model, data), **_tol(kind))  # type: ignore[operator]
    model[0] = nn.Linear(4, 5).double()
    torch.testing.assert_close(op @ eye, KINDS[kind](model, data), **_tol(kind))  # type: ignore[operator]


def test_lanczos_after_replacement_sees_the_new_model() -> None:
    model, data = _model(0), _data()
    op = HessianOperator(model, data, supervised_loss(CE))
    model.load_state_dict(_model(1).state_dict(), assign=True)
    res = lanczos(op, k=2, seed=0)
    top = torch.linalg.eigvalsh(_hessian(model, data)).abs().sort(descending=True).values[:2]
    torch.testing.assert_close(
        res.eigenvalues.abs().sort(descending=True).values, top, rtol=1e-6, atol=1e-9
    )


def test_replacement_of_another_shape_is_refused_by_name() -> None:
    model, data = _model(0), _data()
    op = HessianOperator(model, data, supervised_loss(CE))
    model[2].weight = nn.Parameter(torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"'2\.weight'.*replaced"):
        op @ torch.ones(op.size, dtype=torch.float64)
    model[2].weight = nn.Parameter(torch.randn(3, 5, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"'2\.weight'.*replaced"):
        op @ torch.ones(op.size, dtype=torch.float64)


def test_jacobian_follows_replaced_parameters() -> None:
    model, data = _model(0), _data()
    J = JacobianOperator(model, data, supervised_forward)
    model.load_state_dict(_model(1).state_dict(), assign=True)
    named = list(model.named_parameters())
    ref = torch.cat([dense_jacobian(model, b, supervised_forward, named) for b in data])
    torch.testing.assert_close(
        J @ torch.eye(J.shape[1], dtype=torch.float64), ref, rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        J.T @ torch.eye(J.shape[0], dtype=torch.float64), ref.T, rtol=1e-10, atol=1e-12
    )


def test_exact_diagonal_follows_replaced_parameters() -> None:
    model, data = _model(0), _data()
    op = GGNOperator(model, data, supervised_forward, supervised_loss_of_output(CE))
    model.load_state_dict(_model(1).state_dict(), assign=True)
    from hessian_eigenthings import diagonal

    torch.testing.assert_close(
        diagonal(op, method="exact").estimate,
        torch.diagonal(_ggn(model, data)),
        rtol=1e-9,
        atol=1e-11,
    )
