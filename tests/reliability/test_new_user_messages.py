"""The third new-user pass: a fresh clone, the docs followed verbatim (routing of the colliding
names, keyword typos, k beyond the operator size, solver order in the 0.x messages)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.loss_fns import supervised_loss


def hessian_op() -> he.HessianOperator:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    data = [(torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,)))]
    return he.HessianOperator(model, data, supervised_loss(nn.CrossEntropyLoss()))


@pytest.mark.parametrize("fn", [he.lanczos, he.deflated_power_iteration])
def test_positional_k_on_a_hessian_operator_is_the_1x_call(fn: Any) -> None:
    # `he.lanczos(op, 5)` went to 0.x: a numpy pair, ascending, and `.eigenvalues` failed
    op = hessian_op()
    res = fn(op, 3, max_iter=2000, tol=1e-6, seed=0)  # must not warn
    assert isinstance(res, he.EigenResult) and res.eigenvalues.shape == (3,)
    w = torch.linalg.eigvalsh(op.to_dense())
    top = w[w.abs().argsort(descending=True)[:3]]
    torch.testing.assert_close(res.eigenvalues, top, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize(
    ("fn", "typo", "meant"),
    [
        (he.lanczos, "whcih", "which"),
        (he.lanczos, "max_iters", "max_iter"),
        (he.deflated_power_iteration, "tolerance", "tol"),
        (he.deflated_power_iteration, "sed", "seed"),
    ],
)
def test_a_keyword_typo_is_one_short_line(fn: Any, typo: str, meant: str) -> None:
    with pytest.raises(TypeError) as info:
        fn(hessian_op(), **{typo: 1})
    name = fn.__name__
    assert str(info.value) == f"{name}() got an unknown argument '{typo}'; did you mean '{meant}'?"


@pytest.mark.parametrize("fn", [he.lanczos, he.deflated_power_iteration])
def test_k_beyond_the_size_states_it_once_and_offers_the_dense_route(fn: Any) -> None:
    op = hessian_op()
    with pytest.raises(ValueError) as info:
        fn(op, k=op.size + 4)
    text = str(info.value)
    assert text.count(str(op.size)) == 1 and "\n" not in text, text
    assert text.count("size") <= 2, text
    assert "torch.linalg.eigvalsh(op.to_dense())" in text, text


def test_k_beyond_a_large_operator_offers_no_dense_route() -> None:
    n = 20_000
    op = he.LambdaOperator(lambda v: v, n)
    with pytest.raises(ValueError) as info:
        he.lanczos(op, k=n + 1)
    assert "eigvalsh" not in str(info.value) and f"exceeds operator size {n}" in str(info.value)
