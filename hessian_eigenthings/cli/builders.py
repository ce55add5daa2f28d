"""The operator a command runs, built from ``(model, dataloader, criterion)`` by the curvature's
registry row: the row holds its builder
(:attr:`~hessian_eigenthings.operators.registry.Curvature.build`); the registry's builders are
re-exported here (``hessian_eigenthings.cli.build_from_loss`` and its siblings, as before they
moved into the row's layer)."""

from __future__ import annotations

from typing import Any

from hessian_eigenthings.cli.problems import CLIError, Problem
from hessian_eigenthings.operators import registry
from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.builders import (
    build_from_loss,
    build_from_loss_of_output,
    build_from_per_sample_loss,
    build_kronecker_factored,
)
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = [
    "build_from_loss",
    "build_from_loss_of_output",
    "build_from_per_sample_loss",
    "build_kronecker_factored",
    "build_operator",
]


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
    try:
        op = row.builder()(
            row.operator_class(), problem.model, problem.dataloader, problem.criterion, options
        )
    except ValueError as exc:  # the options or the model do not suit it: a usage error
        raise CLIError(str(exc)) from None
    # a factored row's operator read the data when built: a CurvatureOperator with model and params
    expected = CurvatureOperator if row.factored else DataCurvatureOperator
    if not isinstance(op, expected):
        raise CLIError(
            f"curvature {operator!r}: its build returned {type(op).__name__}, not a {expected.__name__}"
        )
    return op
