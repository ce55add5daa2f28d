"""Loss-landscape slices: the loss along one or two directions in parameter space.

``loss_landscape`` evaluates ``L(θ + a·d₁)`` on a line or ``L(θ + a·d₁ + b·d₂)``
on a grid, averaged over the data like every operator (weighted by batch size),
with the directions either the top eigenvectors of a curvature operator (an
:class:`~hessian_eigenthings.algorithms.EigenResult`: the plot then shows the
curvature that the eigenvalues measure) or random directions, filter-normalised
as Li et al. (2018) propose so that slices of differently scaled networks can
be compared.

The model is left as it was: parameters are substituted for each evaluation
(``torch.func.functional_call``), never written, so their values and version
counters stay untouched and a pending autograd graph of the user stays valid;
the buffers of training-mode modules (BatchNorm statistics) get private copies
per forward. The data is read once: every batch is evaluated at every grid
point before the next is drawn, so a one-shot iterable works too.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from hessian_eigenthings import _plot_style as style
from hessian_eigenthings._checks import check_count
from hessian_eigenthings.algorithms import EigenResult
from hessian_eigenthings.algorithms._common import progress_bar
from hessian_eigenthings.batching import batch_size, iterate_batches, to_device
from hessian_eigenthings.operators.autodiff import CallWithModel
from hessian_eigenthings.operators.model_guard import (
    RandomForwardWarning,
    draws_randomly,
    private_buffers,
)
from hessian_eigenthings.param_utils import ParamFilter, call_with_values, select_parameters

__all__ = ["LandscapeResult", "loss_landscape", "random_directions"]

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass
class LandscapeResult:
    """Losses on a line (``dims=1``) or a grid (``dims=2``) around the parameters.

    ``losses[i]`` (1-D) or ``losses[i, j]`` (2-D) is the mean loss over the data at
    ``θ + alphas[i]·d₁ (+ betas[j]·d₂)``; ``directions`` are the rows ``d`` (in the
    flat layout of the selected parameters, ``names``); ``center_loss`` is the loss at
    ``θ`` itself (the grid holds it when it contains 0); ``eigenvalues`` the eigenvalues of
    the directions when they are eigenvectors (``directions=EigenResult``), else ``None``.
    """

    alphas: torch.Tensor  # (steps,) float64
    betas: torch.Tensor | None  # (steps,) float64 for a grid, else None
    losses: torch.Tensor  # (steps,) or (steps, steps) float64 on the CPU
    directions: torch.Tensor  # (dims, n) in the parameters' dtype and device
    center_loss: float
    names: list[str]
    kind: str  # "eigenvectors", "random (filter-normalised)", "random", "given"
    eigenvalues: torch.Tensor | None = None  # (dims,) float64 for eigenvector directions

    def title(self) -> str:
        """What the slice shows: the eigenvalues of its directions, or their kind."""
        dims = 1 if self.betas is None else 2
        if self.eigenvalues is not None:
            values = ", ".join(f"{float(v):.3g}" for v in self.eigenvalues)
            return f"loss along the eigenvector{'s' if dims == 2 else ''} of λ = {values}"
        return f"loss along {'a' if dims == 1 else dims} {self.kind} direction{'s' if dims == 2 else ''}"

    def plot(self, ax: Any = None, *, title: str | None = None, **kwargs: Any) -> Any:
        """The slice as a line (1-D) or filled contours (2-D, equal axes); returns the axes.

        The trained point is marked; along eigenvectors the second-order model
        ``L(θ) + λα²/2`` (2-D: ``+ λ₁α²/2 + λ₂β²/2``, dashed contours) is drawn over the
        measured losses, the curve they follow near ``θ`` when the gradient is small. A grid
        is drawn interpolated (bicubic, 8 points per measured interval) so that its contours
        are smooth; the measured values are those at the grid's nodes, in ``losses``.
        ``kwargs`` go to ``ax.plot`` (1-D) or ``ax.contourf`` (2-D).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "LandscapeResult.plot needs matplotlib; install it with `pip install hessian-eigenthings[plotting]`"
            ) from exc
        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4.5))
        lam = None if self.eigenvalues is None else [float(v) for v in self.eigenvalues]
        if self.betas is None:
            a = self.alphas
            ax.plot(
                a.numpy(),
                self.losses.numpy(),
                **{"color": style.MEASURED, "lw": 1.5, "label": "loss", **kwargs},
            )
            if lam is not None:
                fine = torch.linspace(float(a[0]), float(a[-1]), 201, dtype=torch.float64)
                ax.plot(
                    fine.numpy(),
                    (self.center_loss + 0.5 * lam[0] * fine**2).numpy(),
                    color=style.REFERENCE,
                    ls="--",
                    lw=1.0,
                    label="L(θ) + λα²/2",
                )
            ax.plot(
                [0.0], [self.center_loss], "o", color=style.EIGEN, ms=6, zorder=3, label="trained θ"
            )
            ax.set_xlabel("α (along d₁)")
            ax.set_ylabel("loss")
        else:
            a, b, z = _smooth_grid(self.alphas, self.betas, self.losses, per_interval=8)
            filled = ax.contourf(
                a.numpy(), b.numpy(), z.numpy(), **{"levels": 30, "cmap": "viridis", **kwargs}
            )
            ax.figure.colorbar(filled, ax=ax, label="loss")
            if lam is not None:
                model = self.center_loss + 0.5 * lam[0] * a**2 + 0.5 * lam[1] * b**2
                levels = [float(x) for x in filled.levels[1:-1:3]]
                if len(set(levels)) > 1:
                    ax.contour(
                        a.numpy(),
                        b.numpy(),
                        model.numpy(),
                        levels=levels,
                        colors="white",
                        linestyles="--",
                        linewidths=0.7,
                    )
                    ax.plot(
                        [],
                        [],
                        color=style.REFERENCE,
                        ls="--",
                        lw=0.7,
                        label="L(θ) + λ₁α²/2 + λ₂β²/2",
                    )
            ax.plot([0.0], [0.0], "o", color=style.EIGEN, ms=6, zorder=3, label="trained θ")
            ax.set_aspect("equal")
            ax.locator_params(nbins=5)  # square axes of a narrow figure: fewer ticks, readable
            ax.set_xlabel("α (along d₁)")
            ax.set_ylabel("β (along d₂)")
        ax.set_title(self.title() if title is None else title)
        style.finish(ax)
        return ax


def _smooth_grid(
    alphas: torch.Tensor, betas: torch.Tensor, losses: torch.Tensor, per_interval: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grid bicubically interpolated to ``per_interval`` points per interval (for display)."""
    steps = alphas.shape[0]
    fine = (steps - 1) * per_interval + 1
    z = torch.nn.functional.interpolate(
        losses.reshape(1, 1, steps, steps), size=(fine, fine), mode="bicubic", align_corners=True
    ).reshape(fine, fine)
    a = torch.linspace(float(alphas[0]), float(alphas[-1]), fine, dtype=torch.float64)
    b = torch.linspace(float(betas[0]), float(betas[-1]), fine, dtype=torch.float64)
    A, B = torch.meshgrid(a, b, indexing="ij")
    return A, B, z


def random_directions(
    model: nn.Module,
    dims: int = 2,
    *,
    param_filter: ParamFilter | str | Sequence[str] | None = None,
    normalization: Literal["filter", "none"] = "filter",
    seed: int = 0,
) -> torch.Tensor:
    """``dims`` random directions ``(dims, n)`` over the selected parameters.

    Gaussian entries drawn on the CPU from ``seed`` (the global RNG is untouched, the
    numbers are the same on every device). ``normalization="filter"`` (Li et al.
    2018): each filter of a weight (a slice along its first axis: an output unit of a
    linear layer, an output channel of a convolution) is scaled to the norm of the
    same filter of the parameter, and directions along parameters of one dimension
    (biases, normalisation scales) are zero. ``"none"`` leaves unit-variance entries.
    """
    dims = int(check_count("dims", dims) or 0)
    if normalization not in ("filter", "none"):
        raise ValueError(f"normalization must be 'filter' or 'none', got {normalization!r}")
    selected = list(select_parameters(model, param_filter).items())
    gen = torch.Generator().manual_seed(int(seed))
    rows = []
    for _ in range(dims):
        parts = []
        for _, p in selected:
            d = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if normalization == "filter":
                if p.dim() <= 1:
                    d.zero_()
                else:
                    w = p.detach().to(device="cpu", dtype=torch.float64)
                    d_norm = d.flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
                    d *= (w.flatten(1).norm(dim=1) / d_norm).reshape(-1, *([1] * (p.dim() - 1)))
            parts.append(d.reshape(-1))
        rows.append(torch.cat(parts))
    first = selected[0][1]
    return torch.stack(rows).to(device=first.device, dtype=first.dtype)


def _directions(
    directions: EigenResult | torch.Tensor | str,
    model: nn.Module,
    dims: int,
    n: int,
    *,
    param_filter: ParamFilter | str | Sequence[str] | None,
    normalization: Literal["filter", "none"],
    seed: int,
) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """The ``(dims, n)`` directions of ``loss_landscape``, what they are, and their
    eigenvalues when they are eigenvectors; raises for directions that do not fit."""
    eigenvalues = None
    if isinstance(directions, EigenResult):
        vecs = directions.eigenvectors
        if vecs.shape[0] < dims:
            raise ValueError(
                f"directions holds {vecs.shape[0]} eigenvectors, dims={dims} needs {dims}"
            )
        d = vecs[:dims]
        kind = "eigenvectors"
        eigenvalues = directions.eigenvalues[:dims].to("cpu", torch.float64)
    elif isinstance(directions, str):
        if directions != "random":
            raise ValueError(
                f"directions must be an EigenResult, a tensor or 'random', got {directions!r}"
            )
        d = random_directions(
            model, dims, param_filter=param_filter, normalization=normalization, seed=seed
        )
        kind = "random (filter-normalised)" if normalization == "filter" else "random"
    elif isinstance(directions, torch.Tensor):
        d = directions.reshape(1, -1) if directions.dim() == 1 else directions
        if d.dim() != 2 or (d.shape[0] != dims and d.shape[-1] == dims and d.shape[0] == n):
            d = d.T if d.dim() == 2 else d
        if d.dim() != 2 or d.shape[0] < dims:
            raise ValueError(
                f"directions must be a ({dims}, n) or (n, {dims}) tensor, got shape {tuple(directions.shape)}"
            )
        d = d[:dims]
        kind = "given"
    else:
        raise TypeError(
            f"directions must be an EigenResult, a tensor or 'random', got {type(directions).__name__}"
        )
    if d.shape[-1] != n:
        raise ValueError(
            f"the directions have length {d.shape[-1]}, the selected parameters {n}: pass the "
            "param_filter of the operator the eigenvectors came from"
        )
    if not bool(torch.isfinite(d).all()):
        raise ValueError("directions contain non-finite values")
    return d, kind, eigenvalues


def _loss_sums(
    model: nn.Module,
    dataloader: Iterable[Batch],
    loss_fn: LossFn,
    grid: list[tuple[Any, ...]],  # tolist() numbers
    d: torch.Tensor,
    names: list[str],
    params: Sequence[torch.Tensor],
    num_batches: int | None,
    progress: bool | None,
) -> tuple[torch.Tensor, float, int]:
    """Batch-size-weighted loss sums at ``grid[1:]`` and at the center ``grid[0]`` (the
    parameters moved by ``Σ c_r d_r``, never in place), and the number of samples."""
    device = params[0].device
    theta = [p.detach() for p in params]
    sizes = [p.numel() for p in params]
    shapes = [p.shape for p in params]
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    call = CallWithModel(model, loss_fn)
    sums = torch.zeros(len(grid) - 1, dtype=torch.float64)
    center_sum = 0.0
    total = 0
    modules = list(model.modules())
    with torch.no_grad(), progress_bar(num_batches, "loss landscape", progress) as bar:
        for batch in iterate_batches(dataloader, num_batches):
            batch = to_device(batch, device)
            size = batch_size(batch)
            for i, coords in enumerate(grid):
                step = sum(c * d[r] for r, c in enumerate(coords))
                values = {
                    f"model.{name}": theta[q] + step[offsets[q] : offsets[q + 1]].reshape(shapes[q])
                    for q, name in enumerate(names)
                }
                with private_buffers(model, modules):
                    loss = call_with_values(call, values, (batch,))
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(
                        "loss_fn must return a scalar tensor (the mean loss of the batch)"
                    )
                value = float(loss.detach()) * size
                if i == 0:
                    center_sum += value
                else:
                    sums[i - 1] += value
            total += size
            bar.update(1)
    return sums, center_sum, total


def loss_landscape(
    model: nn.Module,
    dataloader: Iterable[Batch],
    loss_fn: LossFn,
    *,
    directions: EigenResult | torch.Tensor | Literal["random"] = "random",
    dims: int = 1,
    span: float = 1.0,
    steps: int = 21,
    param_filter: ParamFilter | str | Sequence[str] | None = None,
    normalization: Literal["filter", "none"] = "filter",
    num_batches: int | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> LandscapeResult:
    """The mean loss on a line or grid of ``steps`` points per axis over ``[-span, span]``.

    Args:
        model: the model, used as it is (train or eval mode).
        dataloader: an iterable of batches, read once; batches are weighted by their size.
        loss_fn: as for ``HessianOperator``: ``loss_fn(model, batch)`` returns the mean loss
            of a batch.
        directions: an ``EigenResult`` of an operator over the same selected parameters
            (its first ``dims`` eigenvectors, unit vectors: ``span`` is then a distance
            in parameter space, and the second-order model of a 1-D slice is
            ``L(θ) + a·gᵀd + a²λ/2``); ``"random"`` (see :func:`random_directions`,
            ``normalization`` and ``seed`` apply); or a tensor of ``dims`` rows ``(dims, n)``
            (or columns ``(n, dims)``), used as given.
        dims: 1 for a line, 2 for a grid.
        param_filter: the parameters the directions move (default all trainable).
        num_batches: batches to read (default all).
        progress: show a progress bar over the batches (default: on a terminal).

    The model's mode is used as it is; a model that draws random masks in the forward
    (dropout in training mode) gives a noisy surface, and a warning says so.
    """
    dims = int(check_count("dims", dims) or 0)
    if dims not in (1, 2):
        raise ValueError(f"dims must be 1 or 2, got {dims}")
    steps = int(check_count("steps", steps, minimum=2) or 0)
    num_batches = check_count("num_batches", num_batches, allow_none=True)
    if (
        isinstance(span, bool)
        or not isinstance(span, (int, float))
        or not (math.isfinite(span) and span > 0)
    ):
        raise ValueError(f"span must be a positive finite number, got {span!r}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar loss")
    selected = list(select_parameters(model, param_filter).items())
    names = [n for n, _ in selected]
    params = [p for _, p in selected]
    n = sum(p.numel() for p in params)
    device, dtype = params[0].device, params[0].dtype

    d, kind, eigenvalues = _directions(
        directions,
        model,
        dims,
        n,
        param_filter=param_filter,
        normalization=normalization,
        seed=seed,
    )
    d = d.detach().to(device=device, dtype=dtype)

    random = [name or type(m).__name__ for name, m in model.named_modules() if draws_randomly(m)]
    if random:
        warnings.warn(
            f"modules {random[:4]} draw random masks in training mode: every point of the landscape "
            "sees other masks, so the surface is noisy; call model.eval() first for a smooth one",
            RandomForwardWarning,
            stacklevel=2,
        )

    alphas = torch.linspace(-float(span), float(span), steps, dtype=torch.float64)
    betas = alphas.clone() if dims == 2 else None
    points = (
        [(a,) for a in alphas.tolist()]
        if betas is None
        else [(a, b) for a in alphas.tolist() for b in betas.tolist()]
    )
    grid = [(0.0,) * dims, *points]  # the center first, then the points
    sums, center_sum, total = _loss_sums(
        model, dataloader, loss_fn, grid, d, names, params, num_batches, progress
    )
    if total == 0:
        raise ValueError("the dataloader yielded no batch; check that the dataset is not empty")
    losses = sums / total
    return LandscapeResult(
        alphas=alphas,
        betas=betas,
        losses=losses if betas is None else losses.reshape(steps, steps),
        directions=d,
        center_loss=center_sum / total,
        names=names,
        kind=kind,
        eigenvalues=eigenvalues,
    )
