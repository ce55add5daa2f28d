"""Sums of a factor pass: moments ``XᵀX`` on their upper block triangle (:func:`gram_add_`,
mirrored once by :func:`mirror_upper_`) and weighted means with the first weight applied late
(:class:`WeightedSum`)."""

from __future__ import annotations

import torch

from hessian_eigenthings._checks import InternalError

__all__ = ["GRAM_BLOCK", "WeightedSum", "gram_add_", "mirror_upper_"]


#: the row and column blocks of :func:`gram_add_`; moments narrower than two blocks are one product
#: (512: on an H100 in float32, 4096 rows, the split took 0.63-0.72 of the full product's time at
#: widths 2304-4096 and 0.56 at 14336, ahead of 768 and 1024; ``benchmarks/gram_blocks.py``)
GRAM_BLOCK = 512


def gram_add_(out: torch.Tensor, X: torch.Tensor, alpha: float, block: int | None = None) -> bool:
    """``out += alpha · XᵀX`` (``X (rows, d)``), only on the blocks at or above the diagonal when
    ``d`` spans two blocks or more; returns whether the whole of ``out`` was written.

    NOTE [upper block triangle of a moment]: a factor ``Σ aaᵀ`` is symmetric, so its blocks below
    the diagonal repeat those above. A product per block row, ``X[:, i:i+b]ᵀ X[:, i:]``, makes
    about ``(B+1)/2B`` of the full product's flops for ``B`` blocks (58% at GPT-2's 3072 in blocks
    of 512, 56% at 4096, 52% at Llama's 14336), in ``B`` launches with no copy of ``X``; the
    lower blocks are filled once, by :meth:`WeightedSum.mean` (:func:`mirror_upper_`), not per
    batch. The entries
    are the full product's dot products; only cuBLAS's summation order within a block may differ."""
    step = GRAM_BLOCK if block is None else block
    d = X.shape[1]
    if d < 2 * step:
        out.addmm_(X.T, X, alpha=alpha)
        return True
    for i in range(0, d, step):
        out[i : i + step, i:].addmm_(X[:, i : i + step].T, X[:, i:], alpha=alpha)
    return False


def mirror_upper_(M: torch.Tensor) -> torch.Tensor:
    """``M`` with its strictly lower triangle replaced by the transpose of the upper one, in place
    (NOTE [upper block triangle of a moment])."""
    rows, cols = torch.tril_indices(M.shape[0], M.shape[1], offset=-1, device=M.device)
    M[rows, cols] = M[cols, rows]
    return M


class WeightedSum:
    """``Σ wᵢ Xᵢ / total``, accumulated in place; the first term's weight is applied late.

    NOTE [factor weights applied late]: with one batch (the common case) a factor's weights cancel
    (``size · X / size``), and a multiply and a divide per factor, two launches each on dozens of
    modules, cost more host time than the arithmetic they do; so the first term is kept as it
    comes and its weight is folded into the next term's scaling or into the final division.
    Moments ``XᵀX`` (:meth:`addgram`) are accumulated on their upper block triangle and mirrored
    once, in :meth:`mean` (NOTE [upper block triangle of a moment])."""

    __slots__ = ("scale", "upper", "value")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.scale = 1.0
        #: only the blocks at or above the diagonal hold the sum (:meth:`addgram`)
        self.upper = False

    def _settle(self) -> torch.Tensor:
        if self.value is None:
            raise InternalError("self.value is not None")
        if self.scale != 1.0:
            self.value.mul_(self.scale)
            self.scale = 1.0
        return self.value

    def add(self, X: torch.Tensor, weight: float) -> None:
        if self.value is None:
            self.value, self.scale = X, weight
        else:
            self._settle().add_(X, alpha=weight)

    def addmm(self, a: torch.Tensor, b: torch.Tensor, weight: float) -> None:
        """Adds ``weight · a @ b`` (one fused product-and-add after the first term)."""
        if self.value is None:
            self.value, self.scale = a @ b, weight
        else:
            self._settle().addmm_(a, b, alpha=weight)

    def addgram(self, X: torch.Tensor, weight: float) -> None:
        """Adds ``weight · XᵀX`` of the rows of ``X`` (NOTE [upper block triangle of a moment])."""
        if self.value is None:  # the sum is value · scale: the first weight stays late
            self.value, self.scale = X.new_zeros(X.shape[1], X.shape[1]), weight
        whole = gram_add_(self.value, X, weight / self.scale)
        self.upper = self.upper or not whole

    def mean(self, total: float) -> torch.Tensor:
        if self.value is None:
            raise InternalError("self.value is not None")
        if self.upper:
            mirror_upper_(self.value)
            self.upper = False
        factor = self.scale / total
        return self.value if factor == 1.0 else self.value.mul_(factor)
