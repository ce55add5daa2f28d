"""Spectral density by stochastic Lanczos quadrature (SLQ).

Math. The spectral density ``φ(t) = (1/n) Σᵢ δ(t − λᵢ)`` satisfies
``∫ f dφ = (1/n) tr f(A) = E[vᵀ f(A) v]`` for unit random ``v`` with
``E[v vᵀ] = I/n``. ``m`` Lanczos steps from ``v`` give ``T = S Θ Sᵀ``, and
the Gauss quadrature ``vᵀ f(A) v ≈ Σ_j S_{0j}² f(θ_j)`` is exact for
polynomials of degree ``< 2m`` (Golub & Meurant; Lin, Saad & Yang 2016;
Ghorbani, Krishnan & Xiao 2019 for Hessians). Averaging the nodes ``θ`` and
weights ``S_{0j}²`` of ``num_runs`` runs and smoothing each node with a
Gaussian of width ``sigma`` gives the density.

Cost: ``num_runs · lanczos_steps`` products, issued as one ``op @ V`` block
of up to ``num_runs`` vectors per step (the runs advance in lockstep);
memory ``runs_per_block · lanczos_steps · n`` working-dtype numbers for the
reorthogonalized bases (runs are split into groups to fit
``memory_budget``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.algorithms._checkpoint import (
    checkpoint_path,
    load_checkpoint,
    rank_entries,
    save_checkpoint,
)
from hessian_eigenthings.algorithms._common import (
    check_operator,
    global_size,
    make_generator,
    operator_backend,
    progress_bar,
    random_rows,
    work_dtype,
)
from hessian_eigenthings.algorithms.basis import CHUNK_BYTES, as_basis_device, panel_width
from hessian_eigenthings.algorithms.lanczos import tridiagonal_runs
from hessian_eigenthings.algorithms.result import LanczosTridiag, SpectralDensityResult
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = ["default_sigma", "density_on_grid", "gaussian_density", "spectral_density"]


def gaussian_density(
    nodes: torch.Tensor, weights: torch.Tensor, grid: torch.Tensor, sigma: float
) -> torch.Tensor:
    """``Σ_j w_j N(t; θ_j, σ²)`` on ``grid`` (all float64, CPU), in grid chunks."""
    out = torch.empty_like(grid)
    norm = 1.0 / (sigma * math.sqrt(2.0 * math.pi))
    chunk = max(1, 2**21 // max(1, nodes.shape[0]))  # ~16 MiB of temporaries per chunk
    for s in range(0, grid.shape[0], chunk):
        g = grid[s : s + chunk, None]
        out[s : s + chunk] = (torch.exp(-0.5 * ((g - nodes[None, :]) / sigma) ** 2) * weights).sum(
            dim=1
        ) * norm
    return out


def spectral_density(
    op: CurvatureOperator,
    *,
    num_runs: int = 10,
    lanczos_steps: int = 80,
    num_grid_points: int = 10000,
    sigma: float | None = None,
    grid_padding: float = 0.1,
    seed: int | None = None,
    backend: LinAlgBackend | None = None,
    reorthogonalize: bool = True,
    precision: torch.dtype | None = None,
    memory_budget: int = 2**30,
    progress: bool | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_runs: int | None = None,
    basis_device: str | torch.device | None = None,
) -> SpectralDensityResult:
    """Smoothed spectral density of ``op`` by stochastic Lanczos quadrature.

    Args:
        num_runs: independent Rademacher start vectors (variance ``∝ 1/(num_runs · n)``).
        lanczos_steps: Lanczos steps per run (capped at n); the quadrature
            resolves features down to about ``range / lanczos_steps``.
        num_grid_points: points of the evaluation grid.
        sigma: Gaussian width; default ``range / (2 · lanczos_steps)`` where
            ``range`` spans the quadrature nodes.
        grid_padding: the grid extends beyond the nodes by this fraction of
            the range (and by at least ``5 · sigma``, so the density
            integrates to 1 up to quadrature error of the grid).
        reorthogonalize: full reorthogonalization (default) keeps the nodes
            free of ghost copies; ``False`` saves memory (two vectors per run).
        memory_budget: bytes the reorthogonalized bases may take; runs beyond
            it go in further lockstep groups.
        checkpoint: a file to save the finished runs to after each group and to resume
            from (NOTE [resumable density]): a call that finds the file skips the runs
            it holds and gives the same result, bit for bit, as an uninterrupted call
            with the same arguments. The file is kept (a finished one returns at once).
            With a sharded backend, give each rank a file of its own (another rank's, or one
            of another rank count, is refused).
        checkpoint_runs: runs per group when checkpointing (default: as many as
            ``memory_budget`` allows): the most work an interruption can lose.
        basis_device: where the reorthogonalized bases live; default (``None``) the
            operator's device. ``"cpu"``: host memory (pinned for a CUDA operator), streamed
            to the device in panels as in :func:`lanczos` (NOTE [basis off the device] in
            ``basis``); ``memory_budget`` then bounds host memory. The same result to rounding.
    """
    op = check_operator(op)
    backend = operator_backend(op, backend)
    num_runs = check_count("num_runs", num_runs)
    lanczos_steps = check_count("lanczos_steps", lanczos_steps)
    num_grid_points = check_count("num_grid_points", num_grid_points, minimum=2)
    memory_budget = check_count("memory_budget", memory_budget)
    check_count("seed", seed, minimum=None, allow_none=True)
    if sigma is not None and not sigma > 0:
        raise ValueError(f"sigma must be > 0 or None, got {sigma}")
    if not grid_padding >= 0:
        raise ValueError(f"grid_padding must be >= 0, got {grid_padding}")
    n = op.size  # local shard length (memory); the Krylov depth is capped by the global one
    steps = min(lanczos_steps, global_size(op))
    op.expect_products(num_runs * steps)
    wd = work_dtype(op, precision)
    where = as_basis_device(basis_device)
    gen = make_generator(seed, backend)
    per_run = (steps if reorthogonalize else 2) * n * torch.empty((), dtype=wd).element_size()
    group = _group_size(num_runs, per_run, memory_budget, checkpoint, checkpoint_runs)

    nodes: list[torch.Tensor] = []
    weights: list[torch.Tensor] = []
    first = 0
    path = checkpoint_path(checkpoint)
    config: dict[str, Any] = {
        "num_runs": num_runs,
        "steps": steps,
        "group": group,
        "n": global_size(op),
        "seed": seed,
        "reorthogonalize": reorthogonalize,
        "work_dtype": str(wd),
        "op_dtype": str(op.dtype),
        **rank_entries(backend),  # NOTE [checkpoints of sharded runs] in `_checkpoint`
    }
    if where is not None and reorthogonalize:  # sums over panels of this width
        config["basis_panel"] = panel_width(group * steps, n, wd, CHUNK_BYTES)
    if path is not None and path.exists():
        saved = load_checkpoint(path, "spectral_density", config, gen)
        first, nodes, weights = int(saved["done"]), list(saved["nodes"]), list(saved["weights"])
    with progress_bar(steps * math.ceil(num_runs / group), "spectral density", progress) as bar:
        bar.update(steps * (first // group))
        for start in range(first, num_runs, group):
            r = min(group, num_runs - start)
            V0 = random_rows(r, n, gen, device=op.device, dtype=wd, distribution="rademacher")
            runs = tridiagonal_runs(
                op,
                V0,
                steps,
                reorthogonalize=reorthogonalize,
                backend=backend,
                precision=precision,
                keep_basis=False,
                bar=bar,
                basis_device=where,
            )
            for run in runs:
                theta, weight = _quadrature(run)
                nodes.append(theta)
                weights.append(weight)
            if path is not None:
                state = {"done": start + r, "nodes": nodes, "weights": weights}
                save_checkpoint(path, "spectral_density", config, state, gen)
    raw_nodes, raw_weights = _rows(nodes, weights)
    flat = ~torch.isnan(raw_nodes)
    flat_nodes, flat_weights = raw_nodes[flat], raw_weights[flat] / num_runs
    if sigma is None:
        sigma = default_sigma(flat_nodes, steps)
    grid, density = density_on_grid(flat_nodes, flat_weights, sigma, num_grid_points, grid_padding)
    return SpectralDensityResult(
        grid=grid,
        density=density,
        raw_eigenvalues=raw_nodes,
        raw_weights=raw_weights,
        sigma=float(sigma),
    )


def _group_size(
    num_runs: int,
    per_run: int,
    memory_budget: int,
    checkpoint: str | os.PathLike[str] | None,
    checkpoint_runs: int | None,
) -> int:
    """Runs per lockstep group: as many bases as fit ``memory_budget``, at most
    ``checkpoint_runs``."""
    group = max(1, min(num_runs, memory_budget // max(per_run, 1)))
    checkpoint_runs = check_count("checkpoint_runs", checkpoint_runs, allow_none=True)
    if checkpoint_runs is not None:
        if checkpoint is None:
            raise ValueError(
                "checkpoint_runs is given without checkpoint= (a file to save the runs to)"
            )
        group = min(group, checkpoint_runs)
    return group


def _quadrature(run: LanczosTridiag) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss quadrature nodes and weights of one Lanczos run: the eigenvalues of its ``T``
    and the squared first components of their eigenvectors."""
    T = torch.diag(run.alphas)
    if run.iterations > 1:
        T += torch.diag(run.betas, 1) + torch.diag(run.betas, -1)
    theta, S = torch.linalg.eigh(T)
    return theta, S[0] ** 2


def _rows(
    nodes: list[torch.Tensor], weights: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per run (the 1.0 alpha's layout); a run cut short by an exhausted Krylov
    space is padded with NaN nodes and zero weights."""
    m = max(t.shape[0] for t in nodes)
    raw_nodes = torch.full((len(nodes), m), float("nan"), dtype=torch.float64)
    raw_weights = torch.zeros((len(nodes), m), dtype=torch.float64)
    for i, (theta, w) in enumerate(zip(nodes, weights, strict=True)):
        raw_nodes[i, : theta.shape[0]] = theta
        raw_weights[i, : w.shape[0]] = w
    return raw_nodes, raw_weights


def default_sigma(nodes: torch.Tensor, steps: int) -> float:
    """``range / (2 · steps)`` over the quadrature nodes (a small width when they coincide)."""
    lo, hi = float(nodes.min()), float(nodes.max())
    return (hi - lo) / (2.0 * steps) if hi > lo else 1e-3 * max(abs(lo), 1.0)


def density_on_grid(
    nodes: torch.Tensor,
    weights: torch.Tensor,
    sigma: float,
    num_grid_points: int,
    grid_padding: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of :func:`spectral_density` around ``nodes`` and the smoothed density on it,
    from the flat quadrature ``nodes`` and ``weights`` (float64, CPU; weights summing to 1)."""
    lo, hi = float(nodes.min()), float(nodes.max())
    pad = max(grid_padding * (hi - lo), 5.0 * sigma)
    grid = torch.linspace(lo - pad, hi + pad, num_grid_points, dtype=torch.float64)
    return grid, gaussian_density(nodes, weights, grid, sigma)


# NOTE [resumable density]
# The runs are independent: each group of runs draws its start vectors from the generator
# and runs its Lanczos steps, so the state between groups is (runs done, their nodes and
# weights, the generator's state). After each group it goes to the checkpoint file
# (atomically: NOTE [checkpoint files] in `_checkpoint`). A call that finds the file checks
# that it was written by a call with the same arguments (runs, steps, group size, operator
# size, seed, dtypes) and continues from it: the remaining groups draw what they would
# have drawn, so the result is the uninterrupted one, bit for bit, on the same device and
# versions. The group size is part of the arguments: with reorthogonalization each run's
# basis is its own, but the block products of a group may round differently from another
# grouping.
