"""What influence needs to know of a model's loss: a task.

Influence scores rest on one objective, the mean over the training examples of a per-example
loss ``L(z)``:

    objective(θ) = (1/N) Σ_n L(z_n; θ),   C ≈ ∇² objective (GGN, K-FAC, EK-FAC, Hessian)

and the gradients ``∇L(q)``, ``∇L(z)`` of that same per-example loss. A task holds both sides,
so that the curvature and the gradients agree on the scale of ``L``:

- ``per_example_loss(model, batch) -> (B,)``: ``L`` of each example of a batch as the user
  gives it (gradients come from it);
- ``operator_batch(batch)``, ``forward(model, op_batch)`` and ``loss_of_output(output,
  op_batch)``: the batch's mean of ``L`` in the calling conventions of the curvature operators
  (:class:`~hessian_eigenthings.operators.GGNOperator`, the KFAC family), whose batches are
  weighted by their size, so the operator's matrix is the curvature of ``objective``.

Two tasks:

- :func:`supervised_task(criterion)`: batches ``(x, y)``, ``L`` the criterion of one example
  (``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss`` with ``reduction="mean"``;
  an output with more than one value per example, ``(N, C, d...)`` or ``(N, d)``, takes the
  mean over them, as the criterion does).
- :func:`causal_lm_task()`: HuggingFace causal LMs, batches as ``hf_lm_loss`` reads them
  (``input_ids``, optional ``attention_mask`` and ``labels`` with ``-100`` left out; targets
  shifted by one). ``L(z)`` is the **sum** of the sequence's token losses (Kronfluence's
  per-sequence loss), so a long sequence weighs more than a short one, and ``C`` is the
  curvature of the mean over sequences of these sums.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns import (
    hf_lm_forward,
    supervised_forward,
    supervised_loss_of_output,
)
from hessian_eigenthings.loss_fns.huggingface import HFCausalLMLoss
from hessian_eigenthings.loss_fns.protocols import LossOfOutputFn
from hessian_eigenthings.loss_fns.standard import CrossEntropyOutputLoss

__all__ = ["InfluenceTask", "causal_lm_task", "supervised_task"]

IGNORE_INDEX = -100


class InfluenceTask:
    """A per-example loss ``L`` and the same loss in the curvature operators' conventions
    (module docstring). Subclass it for another kind of model: override the four methods."""

    #: the operators' ``loss_of_output(output, op_batch)``: the batch's mean of ``L``
    loss_of_output: LossOfOutputFn

    def operator_batch(self, batch: Batch) -> Batch:
        """The batch as ``forward`` and ``loss_of_output`` read it."""
        return batch

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The model output of an operator batch (``forward_fn`` of the operators)."""
        raise NotImplementedError

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """``L`` of each example of a batch, ``(B,)``."""
        raise NotImplementedError

    def check_batch(self, model: nn.Module, batch: Batch, where: str) -> None:
        """Refuse a batch that cannot give a meaningful gradient, in one line naming ``where``."""


class SupervisedTask(InfluenceTask):
    """``(x, y)`` batches and a criterion (see :func:`supervised_task`)."""

    def __init__(self, criterion: nn.Module) -> None:
        supported = (nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss)
        if not isinstance(criterion, supported):
            raise TypeError(
                "supervised_task takes nn.CrossEntropyLoss(), nn.MSELoss() or nn.BCEWithLogitsLoss(), "
                f"got {criterion!r}; for another loss subclass influence.InfluenceTask"
            )
        if getattr(criterion, "reduction", "mean") != "mean":
            raise ValueError(
                f"supervised_task needs the criterion's reduction='mean' (the objective is a mean "
                f"over examples), got reduction={criterion.reduction!r}"
            )
        self.criterion = criterion
        self.loss_of_output = supervised_loss_of_output(criterion)
        per = copy.copy(criterion)
        per.reduction = "none"
        self._per_element: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = per

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return supervised_forward(model, batch)

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = supervised_forward(model, batch)
        y = batch[1]
        losses = self._per_element(out, y)
        return losses.reshape(losses.shape[0], -1).mean(1)

    def check_batch(self, model: nn.Module, batch: Batch, where: str) -> None:
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise TypeError(
                f"{where}: supervised_task reads batches (x, y), got {type(batch).__name__}"
            )
        y = batch[1]
        ignore = getattr(self.criterion, "ignore_index", None)
        if (
            ignore is not None
            and isinstance(y, torch.Tensor)
            and not y.is_floating_point()
            and bool((y == ignore).any())
        ):
            raise ValueError(
                f"{where}: targets equal to ignore_index={ignore} make an example's loss not a "
                "mean over its outputs; drop those examples"
            )

    def __repr__(self) -> str:
        return f"supervised_task({self.criterion!r})"


class _SequenceSumCrossEntropy(CrossEntropyOutputLoss):
    """Cross-entropy of logits ``(B, V, T)`` against targets ``(B, T)`` (``-100`` left out),
    summed over a sequence's tokens and averaged over the ``B`` sequences (``"batchmean"``), with
    its output Hessian (``(diag p − p pᵀ)/B`` per counted token) for the GGN and the KFAC
    family's columns (weight ``1/B`` per term)."""

    def __init__(self) -> None:
        super().__init__(ignore_index=IGNORE_INDEX, reduction="batchmean")

    def __repr__(self) -> str:
        return "causal_lm_task().loss_of_output"


class CausalLMTask(InfluenceTask):
    """HuggingFace causal LMs, per-sequence summed token loss (see :func:`causal_lm_task`)."""

    def __init__(self) -> None:
        self._forward = hf_lm_forward()
        self._targets = HFCausalLMLoss()
        self.loss_of_output = _SequenceSumCrossEntropy()

    def _shifted(self, batch: Batch) -> torch.Tensor:
        """Targets ``(B, T-1)`` with ``-100`` where a position does not count."""
        tgt, valid = self._targets.targets(batch)
        return tgt.masked_fill(~valid, IGNORE_INDEX)

    def operator_batch(self, batch: Batch) -> Batch:
        return (batch, self._shifted(batch))

    def forward(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = self._forward(model, batch[0])
        return logits[:, :-1].transpose(1, 2)  # (B, V, T-1): classes second, as cross-entropy reads

    def per_example_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = self._forward(model, batch)[:, :-1]
        tgt = self._shifted(batch)
        losses = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return losses.view(tgt.shape).sum(1)

    def check_batch(self, model: nn.Module, batch: Batch, where: str) -> None:
        ids = batch if isinstance(batch, torch.Tensor) else _get(batch, "input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(
                f"{where}: causal_lm_task reads input_ids of shape (batch, seq), got "
                f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}"
            )
        get = getattr(model, "get_input_embeddings", None)
        embed = get() if callable(get) else None
        vocab = getattr(embed, "num_embeddings", None)
        if isinstance(vocab, int) and ids.numel() and int(ids.max()) >= vocab:
            raise ValueError(
                f"{where}: token id {int(ids.max())} is outside the model's {vocab} embeddings; "
                "were these batches made with another tokenizer than the model's?"
            )
        counted = (self._shifted(batch) != IGNORE_INDEX).sum(1)
        empty = (counted == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"{where}: sequence{'s' * (len(empty) > 1)} {empty[:5]} "
                f"{'have' if len(empty) > 1 else 'has'} no token that counts (every label -100, "
                "or one token): no loss, no gradient; drop them or give them labels"
            )

    def __repr__(self) -> str:
        return "causal_lm_task()"


def _get(batch: Batch, key: str) -> Any:
    try:
        return batch[key]
    except (KeyError, TypeError, IndexError):
        return None


def supervised_task(criterion: nn.Module) -> InfluenceTask:
    """``(x, y)`` batches; ``L(z) = criterion(model(x), y)`` of one example (the mean over its
    outputs for an output of several values)."""
    return SupervisedTask(criterion)


def causal_lm_task() -> InfluenceTask:
    """HuggingFace causal LMs (``model(**inputs).logits``); ``L(z)`` the sum of the sequence's
    token cross-entropies (targets ``labels[:, 1:]``, ``-100`` left out; without labels
    ``input_ids[:, 1:]`` where ``attention_mask`` is 1)."""
    return CausalLMTask()
