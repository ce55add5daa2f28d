"""Padding rows of ``nn.Embedding(padding_idx=...)`` read only by their lookup: the lookup is a
constant in training (its gradient is zero), so every curvature, on every engine, is the
symmetric matrix with that row's directions projected out (``P·A·P``), equal across engines (a
row the model also reads elsewhere, a tied head: ``test_padding_rows_tied.py``). Oracles: reverse-mode only
(``torch.func.jacrev`` twice for the Hessian, the reverse-mode Jacobian for the GGN, per-sample
gradients from plain autograd for the empirical Fisher), float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings import (
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
)
from hessian_eigenthings.loss_fns import (
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.testing import dense_hessian, dense_jacobian


class Tokens(nn.Module):
    def __init__(self, emb: nn.Module) -> None:
        super().__init__()
        self.emb = emb
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.emb(x)).mean(1))


def _model(**kw: object) -> nn.Module:
    torch.manual_seed(0)
    return Tokens(nn.Embedding(6, 3, padding_idx=0, **kw)).double()  # type: ignore[arg-type]


X = torch.tensor([[0, 1, 2], [3, 0, 0], [4, 5, 0], [1, 1, 2]])
Y = torch.tensor([0, 1, 2, 3])
DATA = [(X[:3], Y[:3]), (X[3:], Y[3:])]
CE = nn.CrossEntropyLoss()


def _projector(model: nn.Module) -> torch.Tensor:
    """``P``: the identity with the padding row's coordinates zeroed (embedding weight first)."""
    n = sum(p.numel() for p in model.parameters())
    keep = torch.ones(n, dtype=torch.float64)
    keep[: model.emb.embedding_dim] = 0.0  # type: ignore[union-attr]
    return torch.diag(keep)


def _hessian(model: nn.Module) -> torch.Tensor:
    return dense_hessian(model, DATA, supervised_loss(CE), list(model.named_parameters()))


def _ggn(model: nn.Module) -> torch.Tensor:
    named = list(model.named_parameters())
    acc = torch.zeros(())
    for batch in DATA:
        J = dense_jacobian(model, batch, supervised_forward, named)
        out = model(batch[0]).detach()
        H = torch.func.jacrev(torch.func.jacrev(lambda o, b=batch: CE(o, b[1])))(out).reshape(
            out.numel(), -1
        )
        acc = acc + len(batch[1]) * (J.T @ H @ J)
    return acc / len(Y)


def _fisher(model: nn.Module) -> torch.Tensor:
    grads = []
    for x, y in DATA:
        for i in range(len(y)):
            model.zero_grad()
            CE(model(x[i : i + 1]), y[i : i + 1]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # type: ignore[union-attr]
            model.zero_grad()
    for p in model.parameters():
        p.grad = None
    G = torch.stack(grads)
    return G.T @ G / G.shape[0]


def _op(kind: str, model: nn.Module, engine: str, **kw: object) -> he.CurvatureOperator:
    if kind == "hessian":
        return HessianOperator(model, DATA, supervised_loss(CE), engine=engine, **kw)  # type: ignore[arg-type]
    if kind == "ggn":
        return GGNOperator(
            model, DATA, supervised_forward, supervised_loss_of_output(CE), engine=engine, **kw
        )  # type: ignore[arg-type]
    return EmpiricalFisherOperator(model, DATA, supervised_per_sample_loss(CE), engine=engine, **kw)  # type: ignore[arg-type]


ORACLES = {"hessian": _hessian, "ggn": _ggn, "fisher": _fisher}


@pytest.mark.parametrize("engine", ["autograd", "functional"])
@pytest.mark.parametrize("kind", ["hessian", "ggn", "fisher"])
def test_padding_row_is_a_constant_on_every_engine(kind: str, engine: str) -> None:
    model = _model()
    P = _projector(model)
    ref = P @ ORACLES[kind](model) @ P
    A = _op(kind, model, engine).to_dense()
    torch.testing.assert_close(A, A.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(A, ref, rtol=1e-9, atol=1e-11)
    assert ref.norm() > 0.1


def test_finite_difference_hessian_projects_the_padding_row() -> None:
    model = _model()
    P = _projector(model)
    A = HessianOperator(model, DATA, supervised_loss(CE), method="finite_difference").to_dense()
    torch.testing.assert_close(A, P @ _hessian(model) @ P, rtol=1e-5, atol=1e-6)


def test_compiled_engine_projects_the_padding_row() -> None:
    # inductor's C++ backend on the CPU: slow, so one small case
    model = _model()
    P = _projector(model)
    op = _op("hessian", model, "compiled")
    A = op @ torch.eye(op.size, dtype=torch.float64)
    torch.testing.assert_close(A, P @ _hessian(model) @ P, rtol=1e-9, atol=1e-11)


def test_a_vector_passed_in_is_not_modified() -> None:
    model = _model()
    op = _op("hessian", model, "functional")
    v = torch.ones(op.size, dtype=torch.float64)
    op @ v
    assert torch.equal(v, torch.ones_like(v))


def test_jacobian_has_zero_padding_columns_both_ways() -> None:
    model = _model()
    P = _projector(model)
    named = list(model.named_parameters())
    ref = torch.cat([dense_jacobian(model, b, supervised_forward, named) for b in DATA]) @ P
    J = JacobianOperator(model, DATA, supervised_forward)
    eye = torch.eye(J.shape[1], dtype=torch.float64)
    torch.testing.assert_close(J @ eye, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        J.T @ torch.eye(J.shape[0], dtype=torch.float64), ref.T, rtol=1e-10, atol=1e-12
    )


def test_padding_row_left_out_of_the_selection_costs_nothing() -> None:
    model = _model()
    op = _op("hessian", model, "functional", param_filter="lin.*")
    ref = dense_hessian(
        model,
        DATA,
        supervised_loss(CE),
        [(n, p) for n, p in model.named_parameters() if n.startswith("lin")],
    )
    torch.testing.assert_close(op.to_dense(), ref, rtol=1e-9, atol=1e-11)


def test_embedding_with_max_norm_is_refused() -> None:
    # its forward renormalizes the weight in place: a product would change the user's parameters
    model = _model(max_norm=0.5)
    w = model.emb.weight.detach().clone()  # type: ignore[union-attr]
    for kind in ORACLES:
        with pytest.raises(ValueError, match=r"emb.*max_norm"):
            _op(kind, model, "autograd")
    with pytest.raises(ValueError, match=r"emb.*max_norm"):
        JacobianOperator(model, DATA, supervised_forward)
    assert torch.equal(w, model.emb.weight)  # type: ignore[union-attr]


def test_exact_diagonal_of_the_ggn_and_fisher_is_that_of_the_projection() -> None:
    model = _model()
    P = _projector(model)
    for kind in ("ggn", "fisher"):
        op = _op(kind, model, "autograd")
        ref = torch.diagonal(P @ ORACLES[kind](model) @ P)
        torch.testing.assert_close(
            he.diagonal(op, method="exact").estimate, ref, rtol=1e-9, atol=1e-11
        )  # type: ignore[attr-defined]
