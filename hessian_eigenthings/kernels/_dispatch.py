"""Resolution of ``impl=`` for the cross-entropy product (the one place it happens)."""

from __future__ import annotations

import torch

from hessian_eigenthings.kernels.cross_entropy import cross_entropy_hvp_reference


def run(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: float | torch.Tensor | None,
    *,
    impl: str,
    out: torch.Tensor | None,
) -> torch.Tensor:
    if impl not in ("auto", "eager", "compile", "triton"):
        raise ValueError(f"impl must be 'auto', 'eager', 'compile' or 'triton', got {impl!r}")
    res = cross_entropy_hvp_reference(logits, u, valid, n)
    if out is None:
        return res
    out.copy_(res)
    return out
