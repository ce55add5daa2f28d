"""Fused loss-Hessian products. One dispatch point per kernel family."""

from hessian_eigenthings.kernels.cross_entropy import cross_entropy_hvp, cross_entropy_hvp_reference

__all__ = ["cross_entropy_hvp", "cross_entropy_hvp_reference"]
