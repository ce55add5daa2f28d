"""The ``hessian-eigenthings`` command: top eigenvalues, trace and spectral density of a model.

With no arguments it needs nothing from the network: a small MLP is trained
for a fixed number of steps on scikit-learn's bundled digits (synthetic
Gaussian clusters when scikit-learn is missing, or with ``--synthetic``),
then Lanczos gives the top-k eigenvalues, Hutch++ the trace and stochastic
Lanczos quadrature the spectral density of the chosen curvature (Hessian,
GGN or empirical Fisher). Results are printed as a table and written to the
output folder as ``results.json`` and, when matplotlib is installed,
``spectrum.png``.

A user's own model: ``--model module:function`` or
``--model path/to/file.py:function``, where ``function()`` takes no
arguments and returns ``(model, dataloader, criterion)``:

- ``model``: a ``torch.nn.Module``;
- ``dataloader``: an iterable of batches ``(inputs, targets)``, iterable
  more than once (a ``DataLoader`` or a list of batches);
- ``criterion``: ``criterion(model(inputs), targets) -> scalar mean loss``,
  e.g. ``nn.CrossEntropyLoss()`` (the 0.x contract).

The package: ``parser`` (the options), ``problems`` (the built-in problem, a user's
``--model`` and its data), ``builders`` (the operator of ``--operator``, by its registry row's
builder), ``run`` (the computation and ``main``), ``plots`` and
``output`` (figures, JSON and where they go).
"""

from __future__ import annotations

from hessian_eigenthings.cli.builders import (
    build_from_loss,
    build_from_loss_of_output,
    build_from_per_sample_loss,
    build_kronecker_factored,
    build_operator,
)
from hessian_eigenthings.cli.parser import build_parser
from hessian_eigenthings.cli.problems import CLIError, Problem, builtin_problem, load_user_problem
from hessian_eigenthings.cli.run import main, resolve_device, run

__all__ = [
    "CLIError",
    "Problem",
    "build_from_loss",
    "build_from_loss_of_output",
    "build_from_per_sample_loss",
    "build_kronecker_factored",
    "build_operator",
    "build_parser",
    "builtin_problem",
    "load_user_problem",
    "main",
    "resolve_device",
    "run",
]
