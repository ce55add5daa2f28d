"""Cross-entropy output-Hessian product, the one formula of the codebase.

For logits ``z`` of one row with ``p = softmax(z)``, the Hessian of
``-log p_y`` with respect to ``z`` is ``diag(p) - p pᵀ`` (independent of the
label). Applied to ``u`` and scaled for a mean over ``n`` rows::

    out = (p ⊙ u − p ⟨p, u⟩) · valid / n

Cost: one softmax and two reductions per row, O(rows × V) memory traffic.
This module holds the eager reference and the dispatch; fused versions are
tested against the reference.
"""

from __future__ import annotations

from typing import Literal

import torch

Impl = Literal["auto", "eager", "compile", "triton"]


def cross_entropy_hvp_reference(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None = None,
    n: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager reference, accumulating in float32 (float64 for float64 logits).

    ``logits`` and ``u``: ``(..., V)``; ``valid``: boolean ``(...)`` rows that
    count (``None``: all); ``n``: the mean's denominator, a number or a 0-d
    tensor (``None``: number of valid rows). Result in the logits dtype.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(acc)
    p = torch.softmax(z, dim=-1)
    pu = p * u.to(acc)
    out = pu - p * pu.sum(dim=-1, keepdim=True)
    if valid is not None:
        out = out * valid.unsqueeze(-1).to(out.dtype)
    if n is None:
        n = valid.sum() if valid is not None else logits.numel() // max(logits.shape[-1], 1)
    out = out / n
    return out.to(logits.dtype)


def _check(logits: torch.Tensor, u: torch.Tensor, valid: torch.Tensor | None) -> None:
    if logits.shape != u.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and u {tuple(u.shape)} must have the same shape"
        )
    if logits.dim() < 1:
        raise ValueError("logits need a class dimension (the last one)")
    if valid is not None and valid.shape != logits.shape[:-1]:
        raise ValueError(
            f"valid must have shape {tuple(logits.shape[:-1])} (one flag per row), got {tuple(valid.shape)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")


def cross_entropy_hvp(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None = None,
    n: float | torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(p ⊙ u − p ⟨p, u⟩) · valid / n`` row-wise, ``p = softmax(logits)``.

    ``impl``: ``"eager"`` (reference), ``"compile"`` (``torch.compile`` of the
    reference), ``"triton"`` (fused kernel, CUDA or ``TRITON_INTERPRET=1``),
    ``"auto"`` (the fastest available for the input). ``out`` may alias ``u``.
    """
    _check(logits, u, valid)
    from hessian_eigenthings.kernels import _dispatch

    return _dispatch.run(logits, u, valid, n, impl=impl, out=out)
