"""The contract every curvature operator satisfies, checked against a dense matrix.

Each operator's tests build an operator and its dense oracle and call
:func:`check_contract`: equal to the oracle (single vectors and blocks),
symmetric, linear, and leaves the model exactly as it found it.
"""

from __future__ import annotations

import torch
from torch import nn

from hessian_eigenthings.operators import CurvatureOperator


def snapshot(model: nn.Module) -> dict[str, object]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": [m.training for m in model.modules()],
    }


def assert_unchanged(model: nn.Module, before: dict[str, object]) -> None:
    after = snapshot(model)
    for n, p in before["params"].items():  # type: ignore[union-attr]
        assert torch.equal(p, after["params"][n]), f"parameter {n} changed"  # type: ignore[index]
    for n, b in before["buffers"].items():  # type: ignore[union-attr]
        assert torch.equal(b, after["buffers"][n]), f"buffer {n} changed"  # type: ignore[index]
    for n, g in before["grads"].items():  # type: ignore[union-attr]
        g2 = after["grads"][n]  # type: ignore[index]
        assert (g is None and g2 is None) or (g is not None and g2 is not None and torch.equal(g, g2)), f".grad of {n} changed"
    assert before["requires_grad"] == after["requires_grad"]
    assert before["modes"] == after["modes"]


def check_contract(op: CurvatureOperator, dense: torch.Tensor, model: nn.Module, *, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    n = op.size
    assert dense.shape == (n, n)
    before = snapshot(model)
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(n, generator=gen, dtype=op.dtype)
    w = torch.randn(n, generator=gen, dtype=op.dtype)
    Av, Aw = op.matvec(v), op @ w
    torch.testing.assert_close(Av, dense.to(op.dtype) @ v, rtol=rtol, atol=atol)
    # symmetric: <w, A v> = <A w, v>
    torch.testing.assert_close(torch.dot(w, Av), torch.dot(Aw, v), rtol=max(rtol, 1e-9), atol=atol)
    # linear
    torch.testing.assert_close(op(2.0 * v - 3.0 * w), 2.0 * Av - 3.0 * Aw, rtol=max(rtol, 1e-9), atol=max(atol, 1e-9))
    # a block equals stacked single products
    V = torch.randn(n, 5, generator=gen, dtype=op.dtype)
    AV = op @ V
    assert AV.shape == (n, 5)
    torch.testing.assert_close(AV, torch.stack([op.matvec(V[:, j].contiguous()) for j in range(5)], dim=1), rtol=max(rtol, 1e-9), atol=max(atol, 1e-9))
    torch.testing.assert_close(AV, dense.to(op.dtype) @ V, rtol=rtol, atol=atol)
    assert_unchanged(model, before)
