"""Result types of the algorithms (frozen dataclasses) and the domain warning.

Shapes are in the field comments; ``n`` is the operator size, ``k`` the
number of eigenpairs, ``m`` the number of Lanczos steps.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


class ConvergenceWarning(UserWarning):
    """An algorithm stopped before meeting its tolerance, or hit numerical trouble."""


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# NOTE [quiet convergence warnings]
# A caller inside the package (the 0.x facade) that judges convergence by its own rule
# turns the core's ConvergenceWarning off for one call. It must not do that with
# warnings.catch_warnings(): entering or leaving it mutates the filter list, which clears
# every module's once-per-location registry, so the user's DeprecationWarnings would be
# shown again on every call of a loop. A context variable changes nothing global.
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("quiet_convergence", default=False)


@contextlib.contextmanager
def quiet_convergence_warnings() -> Iterator[None]:
    """No :class:`ConvergenceWarning` from the algorithms inside this block (no filter change)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def warn_convergence(message: str) -> None:
    """Warn :class:`ConvergenceWarning` at the first frame outside the package (the user's line)."""
    if _QUIET.get():
        return
    level = 2  # stacklevel 2 is the frame of sys._getframe(1), this function's caller
    frame = sys._getframe(1)
    # the router of the top-level names and the algorithms' helpers add frames: count them
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, ConvergenceWarning, stacklevel=level)


@dataclass(frozen=True)
class EigenResult:
    """Eigenpairs of a symmetric operator.

    ``residuals[i]`` is ``||A v_i - λ_i v_i||`` (for unit ``v_i``; how the solver
    computed it is in its docstring). ``converged[i]`` is exactly
    ``residuals[i] <= max(tol · |λ_i|, residual_floor)`` (NOTE [convergence rule]):
    ``tol`` the solver's relative tolerance, ``residual_floor`` the residual that
    rounding alone makes at the operator's scale, which no ``tol`` can ask to beat.
    ``summary()`` marks the pairs that only the floor accepted. The order is the
    solver's (see its docstring): most wanted first.
    """

    eigenvalues: torch.Tensor  # (k,) float64 on the CPU
    eigenvectors: torch.Tensor  # (k, n) unit rows, operator's dtype and device
    residuals: torch.Tensor  # (k,) float64 on the CPU
    iterations: int  # operator products spent (a block of b counts b)
    converged: torch.Tensor  # (k,) bool
    tol: float | None = None  # the relative tolerance the pairs were judged by (None: unknown)
    residual_floor: float = 0.0  # absolute: rounding_level(dtypes) · ||A|| estimate

    def floor_only(self) -> torch.Tensor:
        """``(k,)`` bool: converged only because the residual is at the rounding floor
        (``tol · |λ| < residual <= residual_floor``)."""
        if self.tol is None:
            return torch.zeros_like(self.converged)
        return self.converged & (self.residuals > self.tol * self.eigenvalues.abs())

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """A short human-readable table of the pairs."""
        k = int(self.eigenvalues.shape[0])
        n_conv = int(self.converged.sum())
        lines = [
            f"EigenResult: {k} pairs, {n_conv}/{k} converged, "
            f"{self.iterations} products, n={self.eigenvectors.shape[-1]}",
            # the solvers' tol is relative (residual <= tol * |λ|): that column is the one to
            # compare with it; the absolute one is in the unit of the eigenvalues
            "    i   eigenvalue     residual/|λ|  residual   converged",
        ]
        tiny = torch.finfo(torch.float64).tiny
        by_floor = self.floor_only()
        for i in range(k):
            value, res = float(self.eigenvalues[i]), float(self.residuals[i])
            flag = "True (floor)" if bool(by_floor[i]) else str(bool(self.converged[i]))
            lines.append(
                f"{i:5d}  {value: .6e}  {res / max(abs(value), tiny):.2e}      {res:.2e}   {flag}"
            )
        if self.tol is not None:
            lines.append(
                f"converged: residual <= max(tol·|λ|, floor), tol={self.tol:g}, "
                f"floor={self.residual_floor:.2e} (the residual rounding alone makes at this "
                "operator's scale and dtype)"
            )
        return "\n".join(lines)


# NOTE [convergence rule]
# Every eigensolver flags a pair converged when its residual ||A v - λ v|| is at most
# max(tol · |λ|, floor), floor = rounding_level(work dtype, operator dtype) · ||A||, with ||A||
# estimated by the largest |Ritz value| (|Rayleigh quotient|) the solver saw: about 1.2e-5 ||A||
# in float32, 2.2e-14 ||A|| in float64. A pair whose eigenvalue is small next to ||A|| (the
# bottom of a Hessian's spectrum, which="SA") cannot get its residual below the floor however
# long the solver runs, so a tol that asks for it would never be met; such a pair is accepted
# at the floor. The result carries tol and the floor (EigenResult.tol, .residual_floor), so
# that the flags can be checked against the numbers, and summary() says which pairs only the
# floor accepted (issue 25: a pair at 6.5e-4 relative was flagged converged at tol 1e-4 with
# nothing saying why).


@dataclass(frozen=True)
class SolveResult:
    """Solutions of ``(A + λI) x = b`` for a vector or a block of ``k`` right-hand sides.

    ``residual_norms[j]`` is ``||b_j - (A + λI) x_j|| / ||b_j||``: recomputed with one block
    product at the end (``residuals="exact"``, the default) or the solver's recursive value
    (``"estimate"``); ``converged[j]`` says whether it met ``tol``. A vector ``b`` gives
    ``k = 1``.
    """

    x: (
        torch.Tensor
    )  # (n,) or (n, k) like b; working dtype (the operator's for fp32/fp64), its device
    residual_norms: torch.Tensor  # (k,) float64 on the CPU, relative to ||b_j||
    iterations: int  # iterations of the longest-running column (one block product each)
    converged: torch.Tensor  # (k,) bool
    num_matvecs: int  # operator products spent (a block of b counts b), final residual included
    negative_curvature: torch.Tensor  # (k,) bool: CG met pᵀ(A + λI)p <= 0 there and stopped

    def __str__(self) -> str:
        k = int(self.converged.numel())
        worst = float(self.residual_norms.max()) if k else 0.0
        return (
            f"SolveResult: {int(self.converged.sum())}/{k} columns converged in {self.iterations} "
            f"iterations, {self.num_matvecs} products, largest relative residual {worst:.2e}"
        )


@dataclass(frozen=True)
class TraceResult:
    """A stochastic trace estimate ``tr(A)``."""

    estimate: float
    stderr: float  # standard error of the estimate (from the sample variance)
    samples: torch.Tensor  # (s,) float64 per-probe values whose mean is ``estimate``
    # (q, n) Hutch++'s sketch basis Q (orthonormal rows), kept with ``keep_sketch=True`` to
    # warm-start the next call (``sketch=``); None otherwise
    sketch: torch.Tensor | None = None

    def __repr__(self) -> str:
        # hundreds of per-probe values would bury the two numbers people look for
        s = int(self.samples.numel())
        return (
            f"TraceResult(estimate={self.estimate!r}, stderr={self.stderr!r}, samples=<{s} values>)"
        )


@dataclass(frozen=True)
class DiagonalResult:
    """A stochastic estimate of ``diag(A)``."""

    estimate: torch.Tensor  # (n,) working dtype (fp32/fp64), operator's device
    stderr: torch.Tensor  # (n,) elementwise standard error of the probe part
    num_matvecs: int  # operator products spent


@dataclass(frozen=True)
class LanczosTridiag:
    """One Lanczos run: ``A Vᵀ = Vᵀ T + last_beta · r e_mᵀ`` with ``T = tridiag(betas, alphas, betas)``."""

    alphas: torch.Tensor  # (m,) float64, diagonal of T
    betas: torch.Tensor  # (m - 1,) float64, off-diagonal of T
    basis: torch.Tensor | None  # (m, n) orthonormal rows, None when not kept
    last_beta: float  # norm of the residual after the last step (0: invariant subspace)
    iterations: int  # m, the number of products


@dataclass(frozen=True)
class SpectralDensityResult:
    """A smoothed spectral density from stochastic Lanczos quadrature.

    ``density`` integrates to about 1 over ``grid``; ``raw_eigenvalues`` and
    ``raw_weights`` are the quadrature nodes and weights of each run (as in
    the 1.0 alpha: one row per run, each row's weights sum to 1; a run that
    stopped early, its Krylov space exhausted, is padded with NaN nodes and
    zero weights). ``quadrature()`` gives them flat, for re-smoothing the
    density with another sigma.
    """

    grid: torch.Tensor  # (g,) float64
    density: torch.Tensor  # (g,) float64
    raw_eigenvalues: torch.Tensor  # (num_runs, m) float64, m <= lanczos_steps; NaN padding
    raw_weights: torch.Tensor  # (num_runs, m) float64, rows sum to 1; zero padding
    sigma: float  # width of the Gaussian kernel

    def quadrature(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All runs' nodes ``(q,)`` and weights ``(q,)`` (summing to 1), padding removed."""
        keep = ~torch.isnan(self.raw_eigenvalues)
        runs = self.raw_weights.shape[0]
        return self.raw_eigenvalues[keep], self.raw_weights[keep] / runs

    def plot(
        self,
        ax: Any = None,
        *,
        log: bool = True,
        floor: float = 1e-7,
        title: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Plot the density (log scale by default); returns the matplotlib axes.

        On the log scale the axis stops at ``floor`` times the peak: below it the
        Gaussian tails of the smoothing kernel are far under anything the quadrature
        resolves and would only fill the plot. ``title`` defaults to one that gives σ. Drawn in
        the package's style (its colour unless ``color`` is given, a light grid, a small legend
        when a line is labelled), as ``spectrum.png`` and the other figures.
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "SpectralDensityResult.plot needs matplotlib; install it with "
                "`pip install hessian-eigenthings[plotting]`"
            ) from exc
        if not 0 < floor < 1:
            raise ValueError(f"floor must be in (0, 1) (a fraction of the peak), got {floor}")
        from hessian_eigenthings import _plot_style as style

        if ax is None:
            _, ax = plt.subplots()
        if "color" not in kwargs and "c" not in kwargs:
            kwargs["color"] = style.MEASURED  # the package's look (spectrum.png, landscapes)
        ax.plot(self.grid.numpy(), self.density.numpy(), **kwargs)
        if log:
            ax.set_yscale("log")
            peak = float(self.density.max())
            if peak > 0:
                ax.set_ylim(peak * floor, peak * 3)
        ax.set_xlabel("eigenvalue λ")
        ax.set_ylabel("density")
        ax.set_title(f"spectral density (SLQ, σ = {self.sigma:.2g})" if title is None else title)
        style.finish(ax)
        return ax
