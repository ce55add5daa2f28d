"""Cross-entropy losses of the output with a closed-form output Hessian.

The Hessian product itself lives in :func:`hessian_eigenthings.kernels.cross_entropy_hvp`
(the one place the formula exists); this module only decides, for each
layout of logits and targets, which rows count and what the mean divides by.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.kernels import cross_entropy_hvp

Impl = Literal["auto", "eager", "compile", "triton"]
IMPLS = ("auto", "eager", "compile", "triton")
IGNORE_INDEX = -100


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"fused must be one of {IMPLS}, got {impl!r}")


def cross_entropy_hvp_block(
    logits: torch.Tensor,
    u: torch.Tensor,
    valid: torch.Tensor | None,
    n: float | torch.Tensor,
    *,
    impl: Impl,
) -> torch.Tensor:
    """``∇²CE · u`` for a block ``u`` of shape ``(k, *logits.shape)``, classes last.

    One kernel call per direction: the logits are not copied k times, which
    matters at LM vocabulary sizes where ``(rows, V)`` is the largest tensor.
    """
    if u.shape[1:] != logits.shape:
        raise ValueError(f"u must have shape (k, *{tuple(logits.shape)}), got {tuple(u.shape)}")
    if _torch_compat.tracing():
        # a traced product (operators.engines) records functional ops: no writes into a buffer
        return torch.stack(
            [cross_entropy_hvp(logits, u[j], valid, n, impl=impl) for j in range(u.shape[0])]
        )
    out = torch.empty(u.shape, dtype=logits.dtype, device=logits.device)
    for j in range(u.shape[0]):
        cross_entropy_hvp(logits, u[j], valid, n, impl=impl, out=out[j])
    return out


def upcast(logits: torch.Tensor) -> torch.Tensor:
    # HuggingFace computes the LM loss in float32 for half-precision logits; float64 stays.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


class ShiftedCrossEntropy:
    """Next-token cross-entropy: logits ``(B, T, V)`` at position ``t`` predict token ``t + 1``.

    The mean runs over the target positions that count (``valid``); the last
    position predicts nothing, so its rows of the output Hessian are zero.
    Subclasses say where targets and the valid mask come from.
    """

    def __init__(self, *, fused: Impl = "auto") -> None:
        check_impl(fused)
        self.fused: Impl = fused

    def targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets ``(B, T-1)`` (long) and the boolean mask ``(B, T-1)`` of positions that count."""
        raise NotImplementedError

    def _checked(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            shape = (
                tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            )
            raise ValueError(
                f"causal-LM losses expect logits of shape (batch, seq, vocab), got {shape}"
            )
        tgt, valid = self.targets(batch)
        if tuple(tgt.shape) != (logits.shape[0], logits.shape[1] - 1):
            raise ValueError(
                f"targets of shape {tuple(tgt.shape)} do not fit logits {tuple(logits.shape)}; "
                "labels/tokens must be (batch, seq) like the logits"
            )
        return tgt, valid

    def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        tgt, valid = self._checked(logits, batch)
        rows = upcast(logits[:, :-1])
        masked = tgt.masked_fill(~valid, IGNORE_INDEX)
        return F.cross_entropy(
            rows.reshape(-1, rows.shape[-1]), masked.reshape(-1), ignore_index=IGNORE_INDEX
        )

    def token_losses(self, logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target position's own loss ``(B, T-1)``, exactly 0 and without gradient where
        the position does not count; and the mask ``(B, T-1)`` of the positions that count."""
        tgt, valid = self._checked(logits, batch)
        rows = upcast(logits[:, :-1])
        masked = tgt.masked_fill(~valid, IGNORE_INDEX)
        losses = F.cross_entropy(
            rows.reshape(-1, rows.shape[-1]),
            masked.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return losses.view(valid.shape), valid

    def hvp(self, logits: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor:
        _, valid = self._checked(logits, batch)
        # the kernel gets the unshifted logits with the last position masked out: no
        # strided copy of the logits, and the result already has the output's shape
        last = torch.zeros(valid.shape[0], 1, dtype=torch.bool, device=valid.device)
        rows_valid = torch.cat([valid, last], dim=1)
        n = valid.sum().clamp_min(1)  # all positions ignored: zero Hessian (the loss itself is NaN)
        return cross_entropy_hvp_block(logits, u, rows_valid, n, impl=self.fused)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fused={self.fused!r})"
