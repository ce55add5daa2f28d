"""Operators from ``(model, dataloader, criterion)`` (the 0.x contract, which the command line
takes), one builder per kind of loss argument: the ``build`` of the built-in curvature rows.

Each is a :data:`~hessian_eigenthings.operators.registry.CLIBuilder`,
``build(cls, model, dataloader, criterion, options)``; a ``ValueError`` says the options or the
model do not suit the operator. The registry names them by import path (it is data, read by
``memory`` below the losses); they import no operator: ``cls`` is the row's class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)

__all__ = [
    "build_from_loss",
    "build_from_loss_of_output",
    "build_from_per_sample_loss",
    "build_kronecker_factored",
]

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_from_loss(
    cls: type,
    model: nn.Module,
    dataloader: Iterable[Any],
    criterion: Criterion,
    options: Mapping[str, Any],
) -> Any:
    """``cls(model, dataloader, supervised_loss(criterion), **options)``: operators of a mean loss."""
    return cls(model, dataloader, supervised_loss(criterion), **options)


def build_from_loss_of_output(
    cls: type,
    model: nn.Module,
    dataloader: Iterable[Any],
    criterion: Criterion,
    options: Mapping[str, Any],
) -> Any:
    """``cls(model, dataloader, supervised_forward, supervised_loss_of_output(criterion), ...)``:
    operators of the model output's loss (the GGN); the closed-form output Hessian where the
    criterion has one (cross-entropy, MSE), else a double backward through the loss."""
    loss_of_output = supervised_loss_of_output(criterion)
    closed_form = isinstance(loss_of_output, OutputHessianLoss)
    return cls(
        model,
        dataloader,
        supervised_forward,
        loss_of_output,
        loss_hvp="analytical" if closed_form else "autograd",
        **options,
    )


def build_from_per_sample_loss(
    cls: type,
    model: nn.Module,
    dataloader: Iterable[Any],
    criterion: Criterion,
    options: Mapping[str, Any],
) -> Any:
    """``cls(model, dataloader, supervised_per_sample_loss(criterion), **options)``: operators
    of one loss per sample (the empirical Fisher)."""
    return cls(model, dataloader, supervised_per_sample_loss(criterion), **options)


def build_kronecker_factored(
    cls: type,
    model: nn.Module,
    dataloader: Iterable[Any],
    criterion: Criterion,
    options: Mapping[str, Any],
) -> Any:
    """``cls(model, dataloader, supervised_forward, supervised_loss_of_output(criterion),
    num_batches=...)``: Kronecker-factored operators (KFAC, EKFAC, KFOC), type-2, built in
    passes over the data. Their factors come a batch at a time, so there is no microbatch."""
    if options.get("microbatch_size") is not None:
        raise ValueError(
            f"--microbatch-size does not apply to {cls.__name__}: its factors are summed a batch "
            "at a time (use smaller batches in the dataloader, or --num-batches)"
        )
    try:
        return cls(
            model,
            dataloader,
            supervised_forward,
            supervised_loss_of_output(criterion),
            num_batches=options.get("num_batches"),
        )
    except ValueError as exc:  # an unsupported layer or loss: name the operator
        raise ValueError(f"{cls.__name__}: {exc}") from None
