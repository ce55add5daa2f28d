"""Cross-entropy output-Hessian product, the one formula of the codebase.

For logits ``z`` of one row with ``p = softmax(z)``, the Hessian of
``-log p_y`` with respect to ``z`` is ``diag(p) - p pᵀ`` (independent of the
label). Applied to ``u`` and scaled for a mean over ``n`` rows::

    out = (p ⊙ u − p ⟨p, u⟩) · valid / n

Cost: one softmax and two reductions per row, O(rows × V) memory traffic.
This module holds the eager reference and the public entry point; ``impl=``
is resolved in ``_dispatch``; the fused versions are tested against the
reference.
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


def _check(
    logits: torch.Tensor, u: torch.Tensor, valid: torch.Tensor | None, out: torch.Tensor | None
) -> None:
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
    if valid is not None and valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool mask, got {valid.dtype}")
    if not logits.is_floating_point() or not u.is_floating_point():
        raise TypeError(f"logits and u must be floating point, got {logits.dtype} and {u.dtype}")
    if out is not None and (out.shape != logits.shape or not out.is_floating_point()):
        raise ValueError(
            f"out must be a floating tensor of shape {tuple(logits.shape)}, got {tuple(out.shape)} {out.dtype}"
        )


def _as_bool_mask(valid: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask of any real dtype as a bool mask; other values are refused (a weight is no mask)."""
    if valid.is_complex() or not bool(((valid == 0) | (valid == 1)).all()):
        raise TypeError(
            f"valid must be a bool mask or hold only 0 and 1, got a {valid.dtype} tensor with other "
            "values; to weight rows, scale u (or the result) instead"
        )
    return valid != 0


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

    ``logits``, ``u``: ``(..., V)`` (any strides); ``valid``: boolean
    ``(...)``, a 0/1 mask of another dtype (the 1.0 alpha took float masks;
    checking its values costs one host sync), or None; ``n``: number, 0-d tensor (read on device: no host
    sync), or None (number of valid rows). Result in the logits dtype,
    accumulated in float32 (float64 for float64 logits).

    ``impl``: ``"eager"`` (reference), ``"compile"`` (``torch.compile`` of the
    reference, cached), ``"triton"`` (fused kernel: CUDA, or CPU under
    ``TRITON_INTERPRET=1``; not differentiable), ``"auto"``: eager below
    ``AUTO_EAGER_MAX_VOCAB`` classes, for float64, or when the inputs need
    autograd and Triton would be chosen; otherwise Triton on CUDA when triton
    imports, else ``torch.compile``. ``out`` (written in full) may alias
    ``u``; the Triton kernel then works in place with no temporary.
    """
    if valid is not None and valid.dtype != torch.bool:
        valid = _as_bool_mask(valid)
    _check(logits, u, valid, out)
    from hessian_eigenthings.kernels import _dispatch

    return _dispatch.run(logits, u, valid, n, impl=impl, out=out)
