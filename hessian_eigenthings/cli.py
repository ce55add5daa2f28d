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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from hessian_eigenthings import _plot_style as style
from hessian_eigenthings._version import __version__
from hessian_eigenthings.algorithms import lanczos, spectral_density, trace
from hessian_eigenthings.algorithms.result import EigenResult, SpectralDensityResult, TraceResult
from hessian_eigenthings.batching import batch_size
from hessian_eigenthings.landscape import loss_landscape
from hessian_eigenthings.loss_fns import (
    OutputHessianLoss,
    supervised_forward,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.standard import check_criterion
from hessian_eigenthings.memory import MemoryEstimate, estimate_memory
from hessian_eigenthings.operators import registry
from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = [
    "CLIError",
    "Problem",
    "build_from_loss",
    "build_from_loss_of_output",
    "build_from_per_sample_loss",
    "build_kronecker_factored",
    "build_operator",
    "builtin_problem",
    "load_user_problem",
    "main",
    "run",
]

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class CLIError(Exception):
    """A user error the command reports in one line (exit status 2)."""


class Problem:
    """A model, its data as a list-like iterable of ``(inputs, targets)``, and a criterion."""

    def __init__(
        self, model: nn.Module, dataloader: Iterable[Any], criterion: Criterion, description: str
    ) -> None:
        self.model = model
        self.dataloader = dataloader
        self.criterion = criterion
        self.description = description


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hessian-eigenthings",
        description=(
            "Top eigenvalues (Lanczos), trace (Hutch++) and spectral density (stochastic Lanczos "
            "quadrature) of a model's loss curvature. Without --model: a small MLP trained on "
            "scikit-learn's bundled digits (no download), or synthetic data."
        ),
        epilog=(
            "--model contract: function() takes no arguments and returns (model, dataloader, "
            "criterion); the dataloader yields (inputs, targets) and can be iterated repeatedly; "
            "criterion(model(inputs), targets) is the scalar mean loss, e.g. nn.CrossEntropyLoss()."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    what = parser.add_argument_group("what to compute")
    # choices come from the curvature registry (operators/registry.py), read when the parser is built
    rows = registry.curvatures()
    what.add_argument(
        "--operator",
        choices=[row.name for row in rows],
        default="hessian",
        help="curvature: "
        + "; ".join(f"{row.name}: {row.title}" for row in rows)
        + " (default: hessian)",
    )
    methods = list(dict.fromkeys(m for row in rows for m in row.methods))
    what.add_argument(
        "--method",
        choices=methods,
        default=None,
        help="how products are computed, for the curvatures that have a choice ("
        + "; ".join(
            f"--operator {row.name}: {row.methods[0]} (default) or {', '.join(row.methods[1:])}"
            for row in rows
            if len(row.methods) > 1
        )
        + ")",
    )
    what.add_argument(
        "-k", "--k", type=_positive_int, default=10, help="number of top eigenvalues (default: 10)"
    )
    what.add_argument(
        "--which",
        choices=("LA", "LM", "SA"),
        default="LA",
        help="which eigenvalues: largest algebraic, largest magnitude, smallest algebraic (default: LA)",
    )
    what.add_argument(
        "--max-matvecs",
        type=_positive_int,
        default=None,
        help="product budget of the Lanczos eigensolver (default: the solver's own)",
    )
    what.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="relative residual tolerance of the eigenpairs (default: 1e-4)",
    )
    what.add_argument(
        "--trace-matvecs",
        type=_nonnegative_int,
        default=90,
        help="products spent on the Hutch++ trace estimate, >= 3; 0 skips it (default: 90)",
    )
    what.add_argument(
        "--slq-runs",
        type=_nonnegative_int,
        default=8,
        help="random start vectors of the spectral density; 0 skips it (default: 8)",
    )
    what.add_argument(
        "--slq-steps",
        type=_positive_int,
        default=60,
        help="Lanczos steps per spectral-density run (default: 60)",
    )
    what.add_argument(
        "--grid-points",
        type=_positive_int,
        default=2000,
        help="points of the density grid (default: 2000)",
    )

    what.add_argument(
        "--landscape",
        choices=("none", "1d", "2d"),
        default="none",
        help="also the loss along the top eigenvector (1d) or the top two (2d), written to "
        "landscape.png and results.json (default: none)",
    )
    what.add_argument(
        "--landscape-span",
        type=float,
        default=1.0,
        help="the slice covers [-span, span] along each unit eigenvector, a distance in parameter "
        "space (default: 1.0)",
    )
    what.add_argument(
        "--landscape-steps",
        type=_positive_int,
        default=None,
        help="points per axis of the slice (default: 21; a 2d slice of 21 x 21 points costs 441 "
        "forward passes over the data, no curvature products)",
    )

    model = parser.add_argument_group("model and data")
    model.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        default=None,
        help="your model: 'package.module:function' or 'path/to/file.py:function' returning "
        "(model, dataloader, criterion); see below",
    )
    model.add_argument(
        "--synthetic",
        action="store_true",
        help="built-in model on synthetic data even when scikit-learn is installed",
    )
    model.add_argument(
        "--train-steps",
        type=_nonnegative_int,
        default=100,
        help="full-batch Adam steps that train the built-in model (default: 100, a few seconds)",
    )
    model.add_argument(
        "--num-batches",
        type=_positive_int,
        default=None,
        help="use only the first N batches of the data for every product",
    )
    model.add_argument(
        "--microbatch-size",
        type=_positive_int,
        default=None,
        help="split batches into chunks of this many samples (same result, less memory)",
    )

    run_opts = parser.add_argument_group("run")
    run_opts.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model, the data and every algorithm (default: 0)",
    )
    run_opts.add_argument(
        "--device", default="auto", help="'cpu', 'cuda', 'cuda:1', ... or 'auto' (default: auto)"
    )
    run_opts.add_argument(
        "--dtype",
        choices=tuple(_DTYPES),
        default=None,
        help="working precision; model and floating-point data are cast to it (default: float32 for "
        "the built-in model, the model's own dtype for --model)",
    )
    run_opts.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("he_out"),
        help="where results go: a folder (results.json, spectrum.png, landscape.png in it); a path "
        "ending in .json (that file, with NAME.spectrum.png and NAME.landscape.png beside it); or '-' "
        "(the JSON on stdout, the report on stderr, no plot) (default: ./he_out)",
    )
    run_opts.add_argument("--no-plot", action="store_true", help="write no PNG")
    progress = run_opts.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show progress bars",
    )
    progress.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="never show progress bars (default: only on a terminal)",
    )
    run_opts.add_argument(
        "-q", "--quiet", action="store_true", help="print only errors and the files written"
    )
    run_opts.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads of torch for this run (torch.set_num_threads); 1 is often fastest on a small "
        "or shared machine, see docs/howto/speed.md (default: torch's own setting)",
    )
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    row = registry.curvature(args.operator)
    if args.method is None:
        # curvatures with one product method record "autograd", as before the registry
        args.method = row.methods[0] if row.methods else "autograd"
    elif args.method not in row.methods:
        owners = [r.name for r in registry.curvatures() if args.method in r.methods]
        parser.error(
            f"--method {args.method} applies to --operator {', '.join(owners)} only "
            f"({args.operator} has {'methods ' + ', '.join(row.methods) if row.methods else 'one product method'})"
        )
    if 0 < args.trace_matvecs < 3:
        parser.error(
            f"--trace-matvecs must be 0 (skip) or >= 3 (Hutch++ spends a third on a sketch), got {args.trace_matvecs}"
        )
    if not args.tol > 0:
        parser.error(f"--tol must be positive, got {args.tol}")
    if args.grid_points < 2:
        parser.error(f"--grid-points must be >= 2, got {args.grid_points}")
    if args.model is not None and args.synthetic:
        parser.error(
            "--synthetic selects data for the built-in model; it cannot be combined with --model"
        )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CLIError(
            f"--device: unknown device {name!r}; use 'cpu', 'cuda', 'cuda:N' or 'auto'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: CUDA is not available on this machine; use --device cpu")
    return device


# --------------------------------------------------------------------------
# Problems: the built-in one and the user's
# --------------------------------------------------------------------------


def _digits() -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    data = load_digits()  # bundled with scikit-learn: no download
    x = torch.as_tensor(data.data, dtype=torch.float64) / 16.0
    y = torch.as_tensor(data.target, dtype=torch.long)
    return x, y


def _synthetic(
    gen: torch.Generator, n: int = 1024, d: int = 64, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    # Gaussian clusters that overlap a little, so the trained model keeps a nonzero loss
    centers = torch.randn(classes, d, generator=gen, dtype=torch.float64) * 0.6
    y = torch.randint(0, classes, (n,), generator=gen)
    x = centers[y] + torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, y


def builtin_problem(
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    train_steps: int = 100,
    synthetic: bool = False,
    batch_size: int | None = None,
) -> Problem:
    """The default problem: an MLP 64-32-10 (tanh) trained on digits (or synthetic clusters).

    Deterministic for a given seed: a fixed number of full-batch Adam steps
    (not a time budget). The data is one batch by default (it is small, and
    one batch lets the operator keep its graph across products); pass
    ``batch_size`` to split it.
    """
    gen = torch.Generator().manual_seed(seed)
    loaded = None if synthetic else _digits()
    if loaded is None:
        x, y = _synthetic(gen)
        source = "synthetic Gaussian clusters"
    else:
        x, y = loaded
        source = "scikit-learn digits"
    # standardize features so the tanh units start in their linear range
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-3)
    x, y = x.to(device=device, dtype=dtype), y.to(device)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(x.shape[1], 32), nn.Tanh(), nn.Linear(32, 10)).to(
        device=device, dtype=dtype
    )
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(train_steps):
        opt.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        opt.step()
    for p in model.parameters():
        p.grad = None
    step = batch_size or x.shape[0]
    batches = [(x[i : i + step], y[i : i + step]) for i in range(0, x.shape[0], step)]
    n_params = sum(p.numel() for p in model.parameters())
    description = (
        f"built-in MLP {x.shape[1]}-32-10 (tanh, {n_params} parameters), {train_steps} Adam steps on "
        f"{source} ({x.shape[0]} samples)"
    )
    return Problem(model, batches, criterion, description)


def _load_module(spec: str, location: str) -> Any:
    if location.endswith(".py") or os.sep in location or "/" in location:
        path = Path(location)
        if not path.is_file():
            raise CLIError(f"--model {spec}: file {location!r} not found")
        name = f"_hessian_eigenthings_user_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise CLIError(f"--model {spec}: cannot load {location!r} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        return module
    # like `python -m`, let modules in the working directory be found
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as exc:
        if exc.name is not None and location.startswith(exc.name):
            raise CLIError(
                f"--model {spec}: no module named {location!r}; give an importable module or a path "
                "to a .py file (path/to/file.py:function)"
            ) from None
        raise


def load_user_problem(spec: str) -> Problem:
    """Import ``module:function`` / ``path.py:function`` and check what it returns."""
    location, sep, attr = spec.rpartition(":")
    if not sep or not location or not attr:
        raise CLIError(f"--model expects MODULE:FUNCTION or path/to/file.py:FUNCTION, got {spec!r}")
    module = _load_module(spec, location)
    fn = getattr(module, attr, None)
    if fn is None:
        raise CLIError(f"--model {spec}: {location!r} has no attribute {attr!r}")
    if not callable(fn):
        raise CLIError(f"--model {spec}: {attr!r} is not callable")
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise CLIError(
            f"--model {spec}: {attr}{inspect.signature(fn)} needs arguments; the CLI calls it with none. "
            f"Wrap it in a function without parameters (def make(): return {attr}(...))"
        ) from None
    except ValueError:
        pass  # no signature to inspect (some builtins): just call it
    returned = fn()
    if not isinstance(returned, (tuple, list)) or len(returned) != 3:
        raise CLIError(
            f"--model {spec}: {attr}() must return (model, dataloader, criterion), "
            f"got {type(returned).__name__}"
            + (f" of length {len(returned)}" if isinstance(returned, (tuple, list)) else "")
        )
    model, dataloader, criterion = returned
    if not isinstance(model, nn.Module):
        raise CLIError(
            f"--model {spec}: the model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not isinstance(dataloader, Iterable):
        raise CLIError(
            f"--model {spec}: the dataloader must be iterable, got {type(dataloader).__name__}"
        )
    if not callable(criterion):
        raise CLIError(
            f"--model {spec}: the criterion must be callable as criterion(output, target), "
            f"got {type(criterion).__name__}"
        )
    try:
        check_criterion(criterion, name=f"--model {spec}: the criterion")
    except TypeError as err:
        raise CLIError(str(err)) from None
    if getattr(criterion, "reduction", "mean") not in ("mean", "sum", "batchmean"):
        raise CLIError(
            f"--model {spec}: the criterion must return a scalar loss, but it has "
            f"reduction={criterion.reduction!r}; use reduction='mean'"
        )
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return Problem(
        model, dataloader, criterion, f"{spec} ({type(model).__name__}, {n_params} parameters)"
    )


class _CastBatches:
    """Batches of a user's dataloader with tensors moved to the run's device and dtype, lazily."""

    def __init__(
        self, data: Iterable[Any], device: torch.device, dtype: torch.dtype | None
    ) -> None:
        self.data = data
        self.device = device
        self.dtype = dtype

    def __iter__(self) -> Iterator[Any]:
        for batch in self.data:
            yield _cast(batch, self.device, self.dtype)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


def _cast(batch: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(batch, torch.Tensor):
        if dtype is not None and batch.is_floating_point():
            return batch.to(device=device, dtype=dtype)
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _cast(v, device, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast(b, device, dtype) for b in batch)
    return batch


def _cast_data(
    data: Iterable[Any], device: torch.device, dtype: torch.dtype | None
) -> Iterable[Any]:
    # a list is converted once, so every product sees the same tensor objects (the
    # operators then recognise the batch without comparing contents); anything else lazily
    if isinstance(data, (list, tuple)):
        return [_cast(b, device, dtype) for b in data]
    if hasattr(data, "__len__"):
        return _CastBatches(data, device, dtype)
    return _LazyCast(data, device, dtype)


class _LazyCast(_CastBatches):
    """As :class:`_CastBatches` for iterables without a length."""

    __len__ = None  # type: ignore[assignment]


# --------------------------------------------------------------------------
# Operators: each curvature's registry row names the builder that makes it
# from (model, dataloader, criterion)
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _data_used(data: Iterable[Any], num_batches: int | None) -> tuple[int, int] | None:
    """(samples, batches) one product reads; ``None`` when that would need an extra pass
    over a loader of unknown size."""
    if num_batches is None and not isinstance(data, (list, tuple)):
        return None
    samples = batches = 0
    for batch in itertools.islice(data, num_batches):
        samples += batch_size(batch)
        batches += 1
    return samples, batches


def _log(quiet: bool, *parts: Any) -> None:
    if not quiet:
        print(*parts, flush=True)


def _first_batch(problem: Problem) -> Any:
    """The first batch, checked against the --model contract (one-line errors, exit 2)."""
    first = next(iter(problem.dataloader), None)
    if first is None:
        raise CLIError("the dataloader yielded no batch; check that the dataset is not empty")
    if isinstance(first, Mapping):
        raise CLIError(
            f"the dataloader yields dict batches (keys {', '.join(map(repr, first))}); the command line "
            "takes (inputs, targets) batches only; other layouts need the Python API, with your own "
            "loss_fn(model, batch) (see docs/quickstart.md)"
        )
    if not isinstance(first, (tuple, list)) or len(first) != 2:
        raise CLIError(
            f"the dataloader must yield (inputs, targets) batches, got {type(first).__name__}"
            + (f" of length {len(first)}" if isinstance(first, (tuple, list)) else "")
        )
    return first


class _ScalarCriterion:
    """The user's criterion, checked to return a scalar (a reduction='none' criterion
    would otherwise fail deep inside the first product)."""

    def __init__(self, criterion: Criterion) -> None:
        self.criterion = criterion

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.criterion(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CLIError(
                f"the criterion must return a scalar loss (the mean over the batch), got {shape}; "
                "reduce it, e.g. criterion(output, target).mean()"
            )
        return loss


def _memory_estimate(
    problem: Problem, op: CurvatureOperator, args: argparse.Namespace
) -> MemoryEstimate | None:
    first = _first_batch(problem)
    n = op.size
    # the algorithms run one after another: the largest set of kept vectors counts
    krylov = min(n, max(2 * args.k + 1, 20))
    if args.slq_runs:
        krylov = max(krylov, args.slq_runs * min(args.slq_steps, n))
    if args.trace_matvecs:
        krylov = max(krylov, args.trace_matvecs // 3)
    block = max(1, min(args.slq_runs, 32))
    return estimate_memory(
        problem.model,
        first,
        supervised_loss(problem.criterion),
        operator=args.operator,
        method=args.method,
        block_size=block,
        microbatch_size=args.microbatch_size,
        krylov_size=krylov,
        # the selected parameters: data operators and the Kronecker-factored ones both keep them
        params=getattr(op, "params", None),
    )


_WHICH_WORDS = {  # (heading, legend, eigenvectors): what --which selects, in each place's words
    "LA": ("top {k} eigenvalues, largest first", "top eigenvalues", "top"),
    "LM": ("{k} largest-magnitude eigenvalues", "largest |λ|", "largest-magnitude"),
    "SA": ("bottom {k} eigenvalues, smallest first", "bottom eigenvalues", "bottom"),
}


def _figure(
    eig: EigenResult | torch.Tensor,
    density: SpectralDensityResult | None,
    tr: TraceResult | None,
    which: str,
    title: str,
    notes: str,
    *,
    exact: bool = False,
) -> Any:
    """The summary figure: density with the computed eigenvalues marked, and those by index.

    ``eig``: the Lanczos result, or the eigenvalues themselves; ``exact``: they and the trace
    come from the operator's own eigendecomposition (Kronecker-factored operators)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(
        1,
        2 if density is not None else 1,
        figsize=(11 if density is not None else 6, 4.6),
        squeeze=False,
    )
    values = (
        (eig.eigenvalues if isinstance(eig, EigenResult) else eig)
        .detach()
        .to("cpu", torch.float64)
        .numpy()
    )
    solver = "eigh, exact" if exact else f"Lanczos --which {which}"
    heading, marker, _ = _WHICH_WORDS[which]
    heading = heading.format(k=len(values))
    facts = [notes]
    if tr is not None:
        facts.append(
            f"trace = {tr.estimate:.4g} (exact)"
            if exact
            else f"trace ≈ {tr.estimate:.4g} ± {tr.stderr:.2g} (Hutch++)"
        )
    if which == "SA":
        facts.append(
            f"λ_min {'=' if exact else '≈'} {float(values[0]):.4g} ({'eigh' if exact else 'Lanczos'})"
        )
    elif density is not None:
        facts.append(f"λ_min ≈ {float(density.quadrature()[0].min()):.4g} (smallest SLQ node)")
    if density is not None:
        ax = axes[0, 0]
        density.plot(ax, color=style.MEASURED, lw=1.5, label="SLQ density")
        # many lines would cover the density: the most wanted few, light (all are in the right panel)
        marked = values[: style.MAX_MARKED_EIGENVALUES]
        label = (
            marker
            if len(marked) == len(values)
            else f"{marker} (first {len(marked)} of {len(values)})"
        )
        for j, v in enumerate(marked):
            ax.axvline(
                float(v), color=style.EIGEN, lw=0.8, alpha=0.45, label=label if j == 0 else None
            )
        style.finish(ax, loc="upper right")
    ax = axes[0, -1]
    idx = list(range(1, len(values) + 1))
    ax.plot(idx, values, "o-", color=style.EIGEN, ms=6 if len(values) <= 20 else 3.5)
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_xlabel("index i (most wanted first)")
    ax.set_ylabel("eigenvalue λᵢ")
    ax.set_title(f"{heading} ({solver})")
    # integer ticks, about ten of them: one per index runs together from k ~ 25 on
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=1))
    ax.set_xlim(0.5, len(values) + 0.5)
    style.finish(ax, legend=False)
    # long descriptions (a user's module path) wrap instead of running off the figure
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.text(0.5, 0.01, "   ·   ".join(facts), ha="center", va="bottom", fontsize=8, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _plot(path: Path, fig: Any) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def _floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().to("cpu", torch.float64).tolist()]


class _Destination:
    """Where ``-o`` sends the results: a folder, a ``.json`` file (plots beside it, named after
    it), or ``-`` (the JSON on stdout, no plot)."""

    def __init__(self, output: Path) -> None:
        self.to_stdout = str(output) == "-"
        if output.suffix.lower() == ".json" and not output.is_dir():
            self.folder, self.json, self.prefix = output.parent, output, output.stem + "."
        else:
            self.folder, self.json, self.prefix = output, output / "results.json", ""

    def png(self, name: str) -> Path:
        return self.folder / f"{self.prefix}{name}.png"


def _exact_eigenvalues(op: Any, k: int, which: str) -> torch.Tensor:
    """The ``k`` wanted eigenvalues of the operator's own eigendecomposition, most wanted first."""
    values = op.eigh().eigenvalues.detach().to("cpu", torch.float64)  # (n,) ascending
    if which == "LA":
        return values.flip(0)[:k]
    if which == "SA":
        return values[:k]
    return values[values.abs().argsort(descending=True, stable=True)[:k]]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the computation for parsed options; returns what is written to ``results.json``.

    With ``-o -`` the report goes to stderr and the JSON document to stdout."""
    stdout = sys.stdout
    if str(args.output) != "-":
        return _run(args)
    with contextlib.redirect_stdout(sys.stderr):
        results = _run(args)
    json.dump(results, stdout, indent=1, default=_json_default)
    stdout.write("\n")
    stdout.flush()
    return results


def _run(args: argparse.Namespace) -> dict[str, Any]:
    destination = _Destination(args.output)
    device = resolve_device(args.device)
    dtype = _DTYPES[args.dtype or "float32"]
    quiet = args.quiet
    progress = False if quiet else args.progress
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.model is None:
        problem = builtin_problem(
            seed=args.seed,
            dtype=dtype,
            device=device,
            train_steps=args.train_steps,
            synthetic=args.synthetic,
        )
    else:
        problem = load_user_problem(args.model)
        if args.dtype is not None:
            problem.model.to(dtype=dtype)
        problem.model.to(device=device)
        problem.dataloader = _cast_data(
            problem.dataloader, device, dtype if args.dtype is not None else None
        )
        _first_batch(problem)
        if not isinstance(problem.criterion, nn.Module):
            # nn losses keep their type (the GGN recognises cross-entropy and MSE); their
            # reduction was checked when loading
            problem.criterion = _ScalarCriterion(problem.criterion)
    timings["setup"] = time.perf_counter() - t0
    _log(quiet, f"model: {problem.description}  [{timings['setup']:.1f} s]")

    op = build_operator(
        problem,
        args.operator,
        method=args.method,
        num_batches=args.num_batches,
        microbatch_size=args.microbatch_size,
    )
    if args.k > op.size:
        hint = (
            f"; for all {op.size} eigenvalues at this size, form the dense matrix in Python "
            "(H = op @ torch.eye(op.size, dtype=op.dtype)) and call torch.linalg.eigvalsh(H)"
            if op.size <= 10_000
            else ""
        )
        raise CLIError(
            f"-k {args.k}: k must be between 1 and the operator size n = {op.size}{hint}"
        )
    what = f"{args.operator}" + (
        f" ({args.method})" if registry.curvature(args.operator).methods else ""
    )
    _log(
        quiet,
        f"operator: {what}, n = {op.size} parameters, {str(op.dtype).removeprefix('torch.')} on {device}",
    )
    used = _data_used(problem.dataloader, args.num_batches)
    dtype_name = str(op.dtype).removeprefix("torch.")
    data_line = (
        "all batches of the dataloader"
        if used is None
        else f"{used[0]} samples in {used[1]} batch{'es' if used[1] != 1 else ''}"
    )
    _log(
        quiet,
        f"data per product: {data_line}"
        + (f" (--num-batches {args.num_batches})" if args.num_batches else ""),
    )
    memory = _memory_estimate(problem, op, args)
    if memory is not None:
        _log(quiet, memory.summary())

    results: dict[str, Any] = {
        "version": __version__,
        "torch_threads": torch.get_num_threads(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {
            "description": problem.description,
            "num_parameters": op.size,
            "device": str(device),
            "dtype": dtype_name,
        },
        "data": None if used is None else {"samples": used[0], "batches": used[1]},
        "memory_estimate": None
        if memory is None
        else {**asdict(memory), "required_bytes": memory.required_bytes, "fits": memory.fits},
    }

    t = time.perf_counter()
    k = args.k
    # NOTE [exact factored spectrum]: a Kronecker-factored operator diagonalises block by block
    # (eigendecompositions of its small factors, computed once): its eigenvalues and trace are
    # exact and cost no product, where Lanczos spent 187 products for k = 50 and Hutch++ only
    # estimates. The spectral density stays SLQ (a smoothed histogram of all n eigenvalues
    # would be the same picture, but SLQ is what the other operators show); a landscape needs
    # eigenvectors, which Lanczos gives in the operator's flat layout.
    exact = registry.curvature(args.operator).factored and callable(getattr(op, "eigh", None))
    eig: EigenResult | None = None
    if exact:
        values = _exact_eigenvalues(op, k, args.which)
        timings["eigenvalues"] = time.perf_counter() - t
        results["eigenvalues"] = {
            "which": args.which,
            "method": "eigh",
            "values": _floats(values),
            "matvecs": 0,
        }
        _log(
            quiet,
            f"\n{_WHICH_WORDS[args.which][0].format(k=k)} (exact eigendecomposition of the Kronecker "
            f"factors, 0 products) [{timings['eigenvalues']:.1f} s]",
        )
        _log(quiet, "\n".join(f"{i:5d}  {float(v): .6e}" for i, v in enumerate(values)))
    if not exact or args.landscape != "none":
        # an exact spectrum needs from Lanczos only the landscape's one or two directions
        wanted_vectors = min(k, 1 if args.landscape == "1d" else 2) if exact else k
        eig = lanczos(
            op,
            k=wanted_vectors,
            which=args.which,
            tol=args.tol,
            max_iter=args.max_matvecs,
            seed=args.seed,
            progress=progress,
        )
        if exact:
            results["eigenvectors"] = {
                "method": "lanczos",
                "matvecs": eig.iterations,
                "residuals": _floats(eig.residuals),
            }
            _log(quiet, f"eigenvectors for the landscape: Lanczos, {eig.iterations} products")
        else:
            values = eig.eigenvalues
            timings["eigenvalues"] = time.perf_counter() - t
            results["eigenvalues"] = {
                "which": args.which,
                "method": "lanczos",
                "values": _floats(eig.eigenvalues),
                "residuals": _floats(eig.residuals),
                "converged": [bool(c) for c in eig.converged.tolist()],
                "tol": eig.tol,
                "residual_floor": eig.residual_floor,
                "converged_by_floor": [bool(c) for c in eig.floor_only().tolist()],
                "matvecs": eig.iterations,
            }
            _log(
                quiet,
                f"\n{_WHICH_WORDS[args.which][0].format(k=k)} (Lanczos, which={args.which}, {eig.iterations} products) [{timings['eigenvalues']:.1f} s]",
            )
            _log(quiet, eig.summary())

    tr: TraceResult | None = None
    if args.trace_matvecs and exact:
        t = time.perf_counter()
        estimate = float(cast(Any, op).trace())  # the factored operators have trace()
        timings["trace"] = time.perf_counter() - t
        tr = TraceResult(estimate=estimate, stderr=0.0, samples=torch.empty(0, dtype=torch.float64))
        results["trace"] = {"method": "exact", "estimate": estimate, "stderr": 0.0, "matvecs": 0}
        _log(
            quiet,
            f"\ntrace (exact, from the Kronecker factors, 0 products): {estimate:.6e}  [{timings['trace']:.1f} s]",
        )
    elif args.trace_matvecs:
        t = time.perf_counter()
        tr = trace(
            op, num_matvecs=args.trace_matvecs, method="hutch++", seed=args.seed, progress=progress
        )
        timings["trace"] = time.perf_counter() - t
        results["trace"] = {
            "method": "hutch++",
            "estimate": tr.estimate,
            "stderr": tr.stderr,
            "matvecs": args.trace_matvecs,
        }
        _log(
            quiet,
            f"\ntrace (Hutch++, {args.trace_matvecs} products): {tr.estimate:.6e} ± {tr.stderr:.2e}  [{timings['trace']:.1f} s]",
        )

    density: SpectralDensityResult | None = None
    if args.slq_runs:
        t = time.perf_counter()
        density = spectral_density(
            op,
            num_runs=args.slq_runs,
            lanczos_steps=args.slq_steps,
            num_grid_points=args.grid_points,
            seed=args.seed,
            progress=progress,
        )
        timings["spectral_density"] = time.perf_counter() - t
        grid = density.grid
        nodes, weights = density.quadrature()
        mass = float(torch.trapezoid(density.density, grid))
        results["spectral_density"] = {
            "num_runs": args.slq_runs,
            "lanczos_steps": args.slq_steps,
            "sigma": density.sigma,
            "grid": _floats(grid),
            "density": _floats(density.density),
            "nodes": _floats(nodes),
            "weights": _floats(weights),
        }
        lo, hi = float(nodes.min()), float(nodes.max())
        _log(
            quiet,
            f"\nspectral density (SLQ, {args.slq_runs} runs x {min(args.slq_steps, op.size)} steps): support "
            f"[{lo:.3e}, {hi:.3e}], sigma {density.sigma:.2e}, integrates to {mass:.3f}  "
            f"[{timings['spectral_density']:.1f} s]",
        )

    land = None
    if args.landscape != "none":
        assert eig is not None  # computed above whenever a landscape is asked for
        dims = 1 if args.landscape == "1d" else 2
        wanted = _WHICH_WORDS[args.which][2]
        if k < dims:
            raise CLIError(
                f"--landscape {args.landscape} needs the {wanted} {dims} eigenvectors: pass -k {dims} or more"
            )
        steps = args.landscape_steps or 21
        t = time.perf_counter()
        land = loss_landscape(
            problem.model,
            problem.dataloader,
            supervised_loss(problem.criterion),
            directions=eig,
            dims=dims,
            span=args.landscape_span,
            steps=steps,
            num_batches=args.num_batches,
            progress=progress,
        )
        timings["landscape"] = time.perf_counter() - t
        results["landscape"] = {
            "dims": dims,
            "span": args.landscape_span,
            "alphas": _floats(land.alphas),
            "losses": land.losses.tolist(),
            "center_loss": land.center_loss,
        }
        _log(
            quiet,
            f"\nloss landscape ({args.landscape}, {steps} points per axis along the {wanted} eigenvector"
            f"{'s' if dims == 2 else ''}, span {args.landscape_span:g}): loss {float(land.losses.min()):.4e} to "
            f"{float(land.losses.max()):.4e}, {land.center_loss:.4e} at the parameters  [{timings['landscape']:.1f} s]",
        )

    results["timings_s"] = timings
    results["total_matvecs"] = op.num_matvecs
    written = []
    if not destination.to_stdout:
        out_dir = destination.folder
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIError(
                f"--output: cannot create folder {str(out_dir)!r}: {exc.strerror}"
            ) from None
        with open(destination.json, "w") as f:
            json.dump(results, f, indent=1, default=_json_default)
        written.append(str(destination.json))
    if not args.no_plot and not destination.to_stdout:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "note: matplotlib is not installed, so no plot was written (results.json is complete); "
                "install it with `pip install hessian-eigenthings[plotting]`",
                file=sys.stderr,
            )
        else:
            png = destination.png("spectrum")
            title = f"{registry.curvature(args.operator).title} of {problem.description}"
            notes = f"data: {data_line}, {dtype_name} on {device}"
            _plot(png, _figure(values, density, tr, args.which, title, notes, exact=exact))
            written.append(str(png))
            if land is not None:
                import matplotlib.pyplot as plt

                fig, ax = plt.subplots(figsize=(6, 4.5))
                land.plot(ax)  # the title names the eigenvalues, as in Python
                png = destination.png("landscape")
                _plot(png, fig)
                written.append(str(png))
    timings["total"] = time.perf_counter() - t0
    # also under -q: where the results went is the one thing a quiet run must say
    if not quiet:
        print()
    if destination.to_stdout:
        written.append("the JSON to stdout")
    print(f"wrote {', '.join(written)}  (total {timings['total']:.1f} s)", flush=True)
    return results


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hessian-eigenthings`` and ``python -m hessian_eigenthings``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    threads = torch.get_num_threads()
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        run(args)
    except CLIError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)  # an in-process caller keeps its own setting
    return 0
