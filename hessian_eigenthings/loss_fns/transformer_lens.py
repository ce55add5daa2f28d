"""Loss helpers for TransformerLens ``HookedTransformer`` models.

Batches are token tensors ``(B, T)`` or mappings with ``"tokens"`` (or
``"input_ids"``) and optionally ``"attention_mask"``. The forward is
``model(tokens, return_type="logits")`` (with ``attention_mask=`` when the
batch has one). The loss is TransformerLens' own ``lm_cross_entropy_loss``:
the logits at ``t`` predict token ``t + 1``; with an attention mask a
position counts only when it and the next one are both real tokens; mean
over the positions that count. Its output Hessian is the cross-entropy one
on counted rows and zero elsewhere.

``transformer_lens`` is never imported: only its calling convention is used,
so the helpers also work with stand-ins that follow it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns._cross_entropy import Impl, ShiftedCrossEntropy
from hessian_eigenthings.loss_fns.protocols import ForwardFn, LossFn


def _tokens_and_mask(batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        keys = list(batch.keys())
        key = "tokens" if "tokens" in keys else "input_ids" if "input_ids" in keys else None
        if key is None:
            raise KeyError(f"TransformerLens batches need 'tokens' or 'input_ids', got keys {keys}")
        mask = batch["attention_mask"] if "attention_mask" in keys else None
        return batch[key], mask
    raise TypeError(
        f"TransformerLens helpers expect a token tensor or a mapping with 'tokens', got {type(batch).__name__}"
    )


def tlens_forward() -> ForwardFn:
    """``forward_fn(model, batch) -> logits (B, T, V)`` via ``model(tokens, return_type="logits")``."""

    def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
        tokens, mask = _tokens_and_mask(batch)
        kwargs: dict[str, Any] = {"return_type": "logits"}
        if mask is not None:
            kwargs["attention_mask"] = mask
        logits = model(tokens, **kwargs)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(
                f"model(tokens, return_type='logits') returned {type(logits).__name__}, expected a tensor"
            )
        return logits

    return forward


class TLensLMLoss(ShiftedCrossEntropy):
    """Next-token cross-entropy as ``transformer_lens.utils.lm_cross_entropy_loss`` computes it."""

    def targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = _tokens_and_mask(batch)
        tgt = tokens[:, 1:]
        if mask is None:
            return tgt, torch.ones_like(tgt, dtype=torch.bool)
        m = mask.bool()
        return tgt, m[:, :-1] & m[:, 1:]


def tlens_loss_of_output(*, fused: Impl = "auto") -> TLensLMLoss:
    """Next-token cross-entropy of the logits, closed-form output Hessian."""
    return TLensLMLoss(fused=fused)


def tlens_loss() -> LossFn:
    """``loss_fn(model, batch)``: TransformerLens' next-token cross-entropy of ``model``'s logits."""
    forward = tlens_forward()
    loss = TLensLMLoss()

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        return loss(forward(model, batch), batch)

    return loss_fn
