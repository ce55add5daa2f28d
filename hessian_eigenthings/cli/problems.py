"""The problems the command runs on: the built-in one (an MLP trained on scikit-learn's
digits, or synthetic clusters) and a user's ``--model module:function``, with the checks of
that contract and the cast of its data to the run's device and dtype."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import no_batch_message
from hessian_eigenthings.loss_fns.standard import check_criterion

__all__ = [
    "CLIError",
    "Criterion",
    "Problem",
    "ScalarCriterion",
    "builtin_problem",
    "cast_data",
    "first_batch",
    "load_user_problem",
]

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


def first_batch(problem: Problem) -> Any:
    """The first batch, checked against the --model contract (one-line errors, exit 2)."""
    first = next(iter(problem.dataloader), None)
    if first is None:
        # the user's own loader (drop_last, batch_size) says why, not the device-moving wrapper
        raise CLIError(no_batch_message(getattr(problem.dataloader, "data", problem.dataloader)))
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


class ScalarCriterion:
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


def cast_data(
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
