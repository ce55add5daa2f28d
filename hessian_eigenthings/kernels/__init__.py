"""Fused loss-Hessian products. One dispatch point per kernel family.

* :func:`cross_entropy_hvp` — ``(p ⊙ u − p⟨p, u⟩)·valid/n`` row-wise,
  ``impl="auto" | "eager" | "compile" | "triton"``.
* :func:`fused_cross_entropy` — cross-entropy loss whose double backward is
  that product (no softmax graph kept for Hessian-vector products).
* :func:`lm_head_ce_ggn` — GGN product through an LM head, chunked over rows.
* :func:`resolve_impl` — which implementation ``impl=`` names for given inputs.
"""

from hessian_eigenthings.kernels._dispatch import AUTO_EAGER_MAX_VOCAB
from hessian_eigenthings.kernels._dispatch import resolve as resolve_impl
from hessian_eigenthings.kernels.cross_entropy import cross_entropy_hvp, cross_entropy_hvp_reference
from hessian_eigenthings.kernels.fused_loss import fused_cross_entropy
from hessian_eigenthings.kernels.lm_head import lm_head_ce_ggn

__all__ = [
    "AUTO_EAGER_MAX_VOCAB",
    "cross_entropy_hvp",
    "cross_entropy_hvp_reference",
    "fused_cross_entropy",
    "lm_head_ce_ggn",
    "resolve_impl",
]
