"""Cross-entropy loss whose double backward is the fused Hessian product.

For rows ``i`` with logits ``zᵢ``, target ``yᵢ``, flag ``vᵢ`` (target !=
ignore_index) and ``n`` (number of valid rows for ``"mean"``, 1 for
``"sum"``)::

    L = Σᵢ vᵢ (logsumexp zᵢ − zᵢ[yᵢ]) / n
    ∂L/∂zᵢ = g · vᵢ (softmax zᵢ − e_{yᵢ}) / n                 (g: grad_output)
    ∂⟨w, ∂L/∂z⟩/∂zᵢ = g · vᵢ (pᵢ ⊙ wᵢ − pᵢ ⟨pᵢ, wᵢ⟩) / n       (cross_entropy_hvp)

Autograd through ``F.cross_entropy`` keeps the softmax graph (several tensors
of the logits' size) for the double backward; here the backward is its own
autograd function whose backward is one call to :func:`cross_entropy_hvp`,
so a Hessian-vector product through the loss holds only the logits, the
direction and the output. Forward and gradient run in row chunks with fp32
accumulation, so their temporaries stay at about 256 MiB.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from hessian_eigenthings.kernels.cross_entropy import Impl, cross_entropy_hvp

#: Bytes of float32 temporaries one chunk of the forward / gradient may hold.
_CHUNK_BYTES = 256 * 2**20


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunks(x: torch.Tensor) -> Iterator[slice]:
    """Slices of the first dim whose float32 copy stays near ``_CHUNK_BYTES``.

    Chunking along dim 0 (not flat rows) keeps sliced logits such as
    ``z[:, :-1]`` uncopied.
    """
    if x.dim() < 2:
        yield slice(None)
        return
    per_index = max(1, x[0].numel() * 4)
    step = max(1, _CHUNK_BYTES // per_index)
    for start in range(0, x.shape[0], step):
        yield slice(start, start + step)


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    acc = _acc(logits.dtype)
    out = torch.empty(logits.shape[:-1], dtype=acc, device=logits.device)
    for sl in _chunks(logits):
        torch.logsumexp(logits[sl].to(acc), dim=-1, out=out[sl])
    return out


def _grad(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """``(softmax(z) − onehot(y)) · w`` row-wise, ``w`` already holding valid·g/n."""
    acc = _acc(logits.dtype)
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    safe_t = targets.clamp(min=0).unsqueeze(-1)
    for sl in _chunks(logits):
        wc = w[sl].unsqueeze(-1)
        gc = torch.exp(logits[sl].to(acc) - lse[sl].unsqueeze(-1)).mul_(wc)
        gc.scatter_add_(-1, safe_t[sl], -wc)
        out[sl].copy_(gc)
    return out


class _CrossEntropyGrad(torch.autograd.Function):
    """``∂L/∂z`` as a function of ``(z, g)``; its backward is the fused product."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        valid: torch.Tensor,
        lse: torch.Tensor,
        n: torch.Tensor,
        g: torch.Tensor,
        impl: Impl,
    ) -> torch.Tensor:
        w = valid.to(lse.dtype) * (g.to(lse.dtype) / n)
        ctx.save_for_backward(logits, targets, valid, lse, n, g)
        ctx.impl = impl
        return _grad(logits, targets, lse, w)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, u: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets, valid, lse, n, g = ctx.saved_tensors
        d_logits = d_g = None
        if ctx.needs_input_grad[0]:
            # n/g as a 0-d tensor: the scale g/n is applied on device, no sync.
            d_logits = cross_entropy_hvp(
                logits, u.to(logits.dtype), valid, n / g.to(n.dtype), impl=ctx.impl
            )
        if ctx.needs_input_grad[5]:
            unit = _grad(logits, targets, lse, valid.to(lse.dtype) / n)
            d_g = (unit.to(lse.dtype) * u.to(lse.dtype)).sum().to(g.dtype)
        return d_logits, None, None, None, None, d_g, None


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        mean: bool,
        impl: Impl,
    ) -> torch.Tensor:
        valid = targets != ignore_index
        lse = _logsumexp(logits)
        picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).to(lse.dtype)
        total = torch.where(valid, lse - picked, 0.0).sum()
        n = (
            valid.sum().to(lse.dtype)
            if mean
            else torch.ones((), dtype=lse.dtype, device=lse.device)
        )
        ctx.save_for_backward(logits, targets, valid, lse, n)
        ctx.impl = impl
        return (total / n).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, targets, valid, lse, n = ctx.saved_tensors
        # Autograd records this call when the backward itself is differentiated
        # (create_graph=True): the Hessian product then runs through
        # _CrossEntropyGrad.backward, never through a softmax graph.
        grad = _CrossEntropyGrad.apply(logits, targets, valid, lse, n, g, ctx.impl)
        return grad, None, None, None, None


def fused_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    impl: Impl = "auto",
) -> torch.Tensor:
    """Cross-entropy of ``logits (..., V)`` against class ``targets (...)``.

    Same value and derivatives as ``F.cross_entropy(logits.reshape(-1, V),
    targets.reshape(-1), ignore_index=ignore_index, reduction=reduction)``
    (``"mean"``: over non-ignored targets; ``"sum"``), with a second
    derivative computed by :func:`cross_entropy_hvp` (``impl`` picks its
    implementation). For a causal LM pass the shifted pair
    ``logits[:, :-1]``, ``labels[:, 1:]`` (sliced logits are not copied).
    Differentiable twice; a third derivative raises.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if logits.dim() < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape {tuple(logits.shape[:-1])} (logits without the class dim), "
            f"got {tuple(targets.shape)}"
        )
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must hold class indices (int64), got {targets.dtype}")
    out: torch.Tensor = _FusedCrossEntropy.apply(
        logits, targets.long(), ignore_index, reduction == "mean", impl
    )
    return out
