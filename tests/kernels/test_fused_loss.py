"""fused_cross_entropy against F.cross_entropy: value, gradient, double backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hessian_eigenthings.kernels import fused_cross_entropy
from tests.kernels.test_cross_entropy_hvp import DEVICE, needs_triton
from tests.kernels.tolerances import assert_matches


def _lm_case(dtype=torch.float64, B=3, T=6, V=11):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 2] = labels[2, 5] = -100
    return logits, labels


def _derivatives(loss_fn, logits, labels, w, scale=1.7):
    """Loss, gradient, and the Hessian applied to ``w`` (double backward)."""
    z = logits.clone().requires_grad_()
    loss = loss_fn(z[:, :-1], labels[:, 1:])
    (g,) = torch.autograd.grad(scale * loss, z, create_graph=True)
    (hv,) = torch.autograd.grad(g, z, grad_outputs=w)
    return loss.detach(), g.detach(), hv


def _torch_loss(reduction):
    def fn(z, y):
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), reduction=reduction)

    return fn


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_torch_in_float64(reduction):
    logits, labels = _lm_case()
    w = torch.randn_like(logits)
    ours = _derivatives(
        lambda z, y: fused_cross_entropy(z, y, reduction=reduction), logits, labels, w
    )
    ref = _derivatives(_torch_loss(reduction), logits, labels, w)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_hessian_through_a_linear_head_in_float64():
    # What HessianOperator does: double backward to parameters upstream.
    _, labels = _lm_case(V=7)
    h = torch.randn(3, 6, 5, dtype=torch.float64)
    head = torch.nn.Linear(5, 7).double()
    params = list(head.parameters())
    v = [torch.randn_like(p) for p in params]

    def hvp(loss_fn):
        loss = loss_fn(head(h)[:, :-1], labels[:, 1:])
        grads = torch.autograd.grad(loss, params, create_graph=True)
        dot = sum((g * vi).sum() for g, vi in zip(grads, v, strict=True))
        return torch.autograd.grad(dot, params)

    for a, b in zip(hvp(fused_cross_entropy), hvp(_torch_loss("mean")), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_backward_graph_is_the_fused_product():
    logits, labels = _lm_case()
    z = logits.clone().requires_grad_()
    (g,) = torch.autograd.grad(fused_cross_entropy(z, labels), z, create_graph=True)
    # One node, holding logits only: no softmax graph of vocabulary size.
    assert "CrossEntropyGrad" in g.grad_fn.name()


def test_differentiable_in_grad_output():
    logits, labels = _lm_case()
    scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    w = torch.randn_like(logits)

    def dscale(loss_fn):
        z = logits.clone().requires_grad_()
        (g,) = torch.autograd.grad(scale * loss_fn(z, labels), z, create_graph=True)
        return torch.autograd.grad((g * w).sum(), scale)[0]

    torch.testing.assert_close(dscale(fused_cross_entropy), dscale(_torch_loss("mean")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_value_and_gradient(dtype):
    logits, labels = _lm_case(torch.float32, V=300)
    logits = logits.to(dtype)
    z = logits.clone().requires_grad_()
    loss = fused_cross_entropy(z, labels)
    assert loss.dtype == dtype
    (g,) = torch.autograd.grad(loss, z)
    z64 = logits.double().requires_grad_()
    ref = _torch_loss("mean")(z64, labels)
    (g64,) = torch.autograd.grad(ref, z64)
    assert_matches(loss.detach().reshape(1), ref.detach().reshape(1), dtype)
    assert_matches(g, g64, dtype)


@needs_triton
def test_double_backward_through_triton():
    logits, labels = _lm_case(torch.float32, V=1025)
    logits, labels = logits.to(DEVICE), labels.to(DEVICE)
    w = torch.randn_like(logits)
    ours = _derivatives(lambda z, y: fused_cross_entropy(z, y, impl="triton"), logits, labels, w)
    ref = _derivatives(_torch_loss("mean"), logits.double(), labels, w.double())
    for a, b in zip(ours, ref, strict=True):
        assert_matches(a.reshape(-1), b.reshape(-1), torch.float32)


def test_third_derivative_raises():
    logits, labels = _lm_case()
    z = logits.clone().requires_grad_()
    (g,) = torch.autograd.grad(fused_cross_entropy(z, labels), z, create_graph=True)
    (hv,) = torch.autograd.grad(g, z, grad_outputs=torch.ones_like(z), create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(hv.sum(), z)


def test_input_validation():
    z = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="targets must have shape"):
        fused_cross_entropy(z, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="class indices"):
        fused_cross_entropy(z, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="reduction"):
        fused_cross_entropy(z, torch.zeros(2, 3, dtype=torch.long), reduction="none")
