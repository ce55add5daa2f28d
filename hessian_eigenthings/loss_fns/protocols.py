"""The shapes of loss callables, and the protocol of losses with a closed-form output Hessian.

Three kinds of callables meet the operators:

- ``LossFn``: ``loss_fn(model, batch) -> scalar``, the mean loss of a batch
  (:class:`~hessian_eigenthings.operators.HessianOperator`).
- ``ForwardFn`` and ``LossOfOutputFn``: the same loss split at the model
  output, ``loss_of_output(forward_fn(model, batch), batch)``
  (:class:`~hessian_eigenthings.operators.GGNOperator`).
- ``PerSampleLossFn``: ``per_sample_loss_fn(model, batch) -> (N,)``, one
  loss per sample, not divided by ``N``
  (:class:`~hessian_eigenthings.operators.EmpiricalFisherOperator`).

A loss of the output that knows its Hessian with respect to the output
implements :class:`OutputHessianLoss`; the GGN then applies that Hessian in
closed form instead of differentiating the loss twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hessian_eigenthings.batching import Batch

LossFn = Callable[[nn.Module, Batch], torch.Tensor]
ForwardFn = Callable[[nn.Module, Batch], torch.Tensor]
LossOfOutputFn = Callable[[torch.Tensor, Batch], torch.Tensor]
PerSampleLossFn = Callable[[nn.Module, Batch], torch.Tensor]


@runtime_checkable
class OutputHessianLoss(Protocol):
    """A loss of the model output with a closed-form output-Hessian product.

    ``loss(output, batch)`` is the scalar mean loss of the batch.
    ``loss.hvp(output, batch, u)`` returns ``∇²_output loss · u`` for a block
    ``u`` of shape ``(k, *output.shape)`` (k directions at once), in the
    shape of ``u``. It must be exact and must not build an autograd graph.
    """

    def __call__(self, output: torch.Tensor, batch: Batch) -> torch.Tensor: ...

    def hvp(self, output: torch.Tensor, batch: Batch, u: torch.Tensor) -> torch.Tensor: ...
