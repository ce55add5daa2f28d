"""Operators from ``(model, dataloader, criterion)``: each curvature's registry row
(:attr:`~hessian_eigenthings.operators.registry.Curvature.build`) names one of these
builders by import path, ``hessian_eigenthings.cli:build_from_loss`` and its siblings (the
package re-exports them, so those paths resolve)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from hessian_eigenthings.cli.problems import CLIError, Criterion, Problem
from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators import registry
from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = [
    "build_from_loss",
    "build_from_loss_of_output",
    "build_from_per_sample_loss",
    "build_kronecker_factored",
    "build_operator",
]


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
        raise CLIError(
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
    except ValueError as exc:  # an unsupported layer or loss: say so without a traceback
        raise CLIError(f"{cls.__name__}: {exc}") from None


def build_operator(
    problem: Problem,
    operator: str,
    *,
    method: str | None = None,
    num_batches: int | None = None,
    microbatch_size: int | None = None,
) -> CurvatureOperator:
    """The operator the CLI runs, built from ``(model, dataloader, criterion)`` by the curvature's
    registry row (:attr:`~hessian_eigenthings.operators.registry.Curvature.build`)."""
    try:
        row = registry.curvature(operator)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    options: dict[str, Any] = {"num_batches": num_batches, "microbatch_size": microbatch_size}
    if row.methods:
        options["method"] = method if method is not None else row.methods[0]
    op = row.builder()(
        row.operator_class(), problem.model, problem.dataloader, problem.criterion, options
    )
    # a factored row's operator read the data when built: a CurvatureOperator with model and params
    expected = CurvatureOperator if row.factored else DataCurvatureOperator
    if not isinstance(op, expected):
        raise CLIError(
            f"curvature {operator!r}: its build returned {type(op).__name__}, not a {expected.__name__}"
        )
    return op
