"""lm_head_ce_ggn against the unchunked GGN product built by autograd (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hessian_eigenthings.kernels import lm_head_ce_ggn
from tests.kernels.test_cross_entropy_hvp import DEVICE, needs_triton
from tests.kernels.tolerances import assert_matches


def _case(dtype=torch.float64, B=2, T=5, d=4, V=13, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)

    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 0] = labels[1, 3] = -100
    return dict(h=r(B, T, d), W=r(V, d), b=r(V), dh=r(B, T, d), dW=r(V, d), db=r(V), labels=labels)


def _dense_ggn(h, W, b, dh, dW, db, labels):
    """Jᵀ H J δ on full (N, V) tensors: J δ written out for the linear head, H by
    double backward through F.cross_entropy, Jᵀ by autograd."""
    h, W = h.clone().requires_grad_(), W.clone().requires_grad_()
    b0 = (b if b is not None else torch.zeros(W.shape[0], dtype=W.dtype)).clone().requires_grad_()
    logits = h @ W.T + b0
    jv = torch.zeros_like(logits)
    if dh is not None:
        jv += dh @ W.detach().T
    if dW is not None:
        jv += h.detach() @ dW.T
    if db is not None:
        jv += db
    z = logits.detach().requires_grad_()
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1))
    (g,) = torch.autograd.grad(loss, z, create_graph=True)
    (u,) = torch.autograd.grad(g, z, grad_outputs=jv)
    g_h, g_W, g_b = torch.autograd.grad(logits, (h, W, b0), grad_outputs=u)
    return g_h, g_W, g_b if b is not None else None


@pytest.mark.parametrize("chunk_rows", [1, 3, None])
@pytest.mark.parametrize(
    "absent", [(), ("b", "db"), ("dh",), ("dW",), ("db",)], ids=lambda a: "-".join(a) or "full"
)
def test_matches_dense_ggn_in_float64(chunk_rows, absent):
    c = _case()
    for k in absent:
        c[k] = None
    g_h, g_W, g_b = lm_head_ce_ggn(
        c["h"], c["W"], c["b"], c["dh"], c["dW"], c["db"], c["labels"], chunk_rows=chunk_rows
    )
    ref = _dense_ggn(c["h"], c["W"], c["b"], c["dh"], c["dW"], c["db"], c["labels"])
    torch.testing.assert_close(g_h, ref[0], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(g_W, ref[1], rtol=1e-12, atol=1e-13)
    if c["b"] is None:
        assert g_b is None
    else:
        torch.testing.assert_close(g_b, ref[2], rtol=1e-12, atol=1e-13)


def test_shifted_causal_lm_rows_and_masks():
    # The HuggingFace layout: hidden[:, :-1] predicts labels[:, 1:].
    c = _case(T=6)
    h, dh, labels = c["h"][:, :-1], c["dh"][:, :-1], c["labels"][:, 1:]
    args = (h, c["W"], c["b"], dh, c["dW"], c["db"])
    by_labels = lm_head_ce_ggn(*args, labels, chunk_rows=4)
    by_mask = lm_head_ce_ggn(*args, labels != -100, chunk_rows=4)
    ref = _dense_ggn(*args, labels)
    for a, b_, r in zip(by_labels, by_mask, ref, strict=True):
        torch.testing.assert_close(a, r)
        torch.testing.assert_close(b_, r)
    # n given explicitly (e.g. the total over micro-batches) rescales linearly.
    half = lm_head_ce_ggn(*args, labels, 2 * (labels != -100).sum())
    torch.testing.assert_close(half[1], ref[1] / 2)


def test_all_rows_valid_without_labels():
    c = _case()
    args = (c["h"], c["W"], c["b"], c["dh"], c["dW"], c["db"])
    ours = lm_head_ce_ggn(*args, None, chunk_rows=4)
    ref = _dense_ggn(*args, torch.zeros(2, 5, dtype=torch.long))
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r)


def test_not_tracked_by_autograd():
    c = _case()
    W = c["W"].clone().requires_grad_()
    g_h, g_W, _ = lm_head_ce_ggn(c["h"], W, None, c["dh"], None, None, c["labels"])
    assert not g_h.requires_grad and not g_W.requires_grad


def test_shape_validation():
    c = _case()
    with pytest.raises(ValueError, match="W must be"):
        lm_head_ce_ggn(c["h"], c["W"].T, None, None, None, None, None)
    with pytest.raises(ValueError, match="dW must have shape"):
        lm_head_ce_ggn(c["h"], c["W"], None, None, c["W"].T, None, None)
    with pytest.raises(ValueError, match="one entry per row"):
        lm_head_ce_ggn(c["h"], c["W"], None, None, None, None, c["labels"][:, 1:])


@needs_triton
def test_triton_product_in_float32():
    c = _case(torch.float32, V=1100, d=8)
    c = {k: v.to(DEVICE) for k, v in c.items()}
    ours = lm_head_ce_ggn(
        c["h"], c["W"], c["b"], c["dh"], c["dW"], c["db"], c["labels"], chunk_rows=4, impl="triton"
    )
    ref = _dense_ggn(
        *(c[k].double().cpu() for k in ("h", "W", "b", "dh", "dW", "db")), c["labels"].cpu()
    )
    for a, r in zip(ours, ref, strict=True):
        assert_matches(a.cpu(), r, torch.float32)
