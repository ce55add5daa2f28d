"""Curvature along training: sharpness, top-k eigenvalues and trace every ``N`` steps.

:class:`CurvatureTracker` builds one :class:`~hessian_eigenthings.operators.HessianOperator`
on a fixed probe batch (or loader) and, on each due :meth:`CurvatureTracker.step`, runs
``lanczos`` warm-started from its previous result (NOTE [warm starts] in
``algorithms._common``), optionally ``hutch_plus_plus`` warm-started from the previous
sketch basis (NOTE [warm Hutch++ sketch] in ``algorithms.trace``), and optionally a small
``spectral_density`` snapshot (SLQ). The operator reads the parameters in place, so nothing is
rebuilt between calls.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from hessian_eigenthings.algorithms import (
    EigenResult,
    TraceResult,
    hutch_plus_plus,
    lanczos,
    spectral_density,
)
from hessian_eigenthings.algorithms.spectral_density import density_on_grid
from hessian_eigenthings.operators import HessianOperator


@dataclass(frozen=True)
class TrackRecord:
    """One tracked step: the top eigenvalues (most wanted first), the trace estimate (or
    ``None``; ``trace_stderr`` its standard error), the operator products spent, the wall
    time of the computation, and the spectral density snapshot (or ``None``) as its
    quadrature, ``{"nodes": [...], "weights": [...], "sigma": s}``: the Ritz values of all
    SLQ runs and their weights (summing to 1), a few hundred numbers from which
    :meth:`density_curve` draws the smoothed density."""

    step: int
    eigenvalues: list[float]
    trace: float | None
    products: int
    seconds: float
    density: dict[str, Any] | None = None
    trace_stderr: float | None = None  # Hutch++'s standard error of ``trace``

    def density_curve(
        self, num_grid_points: int = 1000, grid_padding: float = 0.1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grid, density)`` of the snapshot, on the grid ``spectral_density`` would use."""
        if self.density is None:
            raise ValueError(
                f"step {self.step} has no density snapshot (CurvatureTracker(density_every=...))"
            )
        nodes = torch.tensor(self.density["nodes"], dtype=torch.float64)
        weights = torch.tensor(self.density["weights"], dtype=torch.float64)
        return density_on_grid(
            nodes, weights, float(self.density["sigma"]), num_grid_points, grid_padding
        )


@contextlib.contextmanager
def _training_untouched(model: nn.Module, eval_mode: bool) -> Iterator[None]:
    """Leave what training sees exactly as found: train/eval flags, buffers, the global RNG
    states (CPU and every initialised CUDA device), grad mode and autocast."""
    # NOTE [tracker leaves training untouched]. The operator's guard already restores the
    # flags and gives training modules private buffers per forward; the tracker adds the
    # global RNG (a dropout layer in training mode would draw from it, and so would the
    # solvers' generators if a caller passed none) and switches the model to eval() for the
    # computation by default, so that dropout is off and BatchNorm uses its running stats:
    # the curvature of the model as evaluated, and the same matrix on every product.
    modes = [m.training for m in model.modules()]
    buffers = [b.detach().clone() for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        if eval_mode:
            model.eval()
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        for m, mode in zip(model.modules(), modes, strict=True):
            m.training = mode
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                if not torch.equal(b, saved):
                    b.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


class CurvatureTracker:
    """Top-``k`` Hessian eigenvalues (and optionally the trace) every ``every`` steps.

    ``CurvatureTracker(model, loss_fn, batch=(x, y))`` (or ``loader=`` an iterable of
    batches): ``loss_fn(model, batch)`` as for ``HessianOperator``. Call :meth:`step` after
    each optimizer step; it computes when ``step % every == 0`` and returns a
    :class:`TrackRecord` (``None`` when not due). ``history`` keeps the records.

    Args:
        k: top eigenvalues (``which="LA"``: largest algebraic, the sharpness; ``"LM"``:
            largest magnitude).
        trace: also estimate ``tr(H)`` by Hutch++ with ``trace_matvecs`` products.
        density_every: also take an SLQ spectral density snapshot at the tracked steps that
            are multiples of this (a multiple of ``every``); ``density_options`` go to
            ``spectral_density`` (default ``num_runs=4, lanczos_steps=30``: ``120`` products).
        tol: Lanczos tolerance. ``seed``: the solvers' seed (local generators).
        residuals: how Lanczos checks convergence (NOTE [tracker residual check]):
            ``"estimate"`` (default) on its residual estimates, ``"exact"`` with ``k`` more
            products (one block) recomputing ``||A v - θ v||``.
        warm_start: start each Lanczos from the previous result (fewer products when the
            parameters moved little; the answer is that of a cold start either way), and
            each Hutch++ sketch from the previous sketch basis (the same products, a smaller
            error when the parameters moved little; unbiased either way; keeps ``q · n``
            numbers, ``q = trace_matvecs // 3``, between calls).
        eval_mode: compute with the model in ``eval()`` (default; no dropout, BatchNorm
            running stats) and restore its flags afterwards; ``False`` keeps its mode.
        operator_options: passed to ``HessianOperator`` (``param_filter``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        batch: Any = None,
        loader: Iterable[Any] | None = None,
        every: int = 1,
        k: int = 1,
        which: Literal["LA", "LM"] = "LA",
        trace: bool = False,
        trace_matvecs: int = 30,
        density_every: int | None = None,
        density_options: Mapping[str, Any] | None = None,
        tol: float = 1e-4,
        residuals: Literal["exact", "estimate"] = "estimate",
        seed: int = 0,
        warm_start: bool = True,
        eval_mode: bool = True,
        **operator_options: Any,
    ) -> None:
        if (batch is None) == (loader is None):
            raise ValueError("pass exactly one of batch= (one probe batch) or loader= (batches)")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if which not in ("LA", "LM"):
            raise ValueError(f"which must be 'LA' or 'LM', got {which!r}")
        if density_every is not None and (
            not isinstance(density_every, int) or density_every < 1 or density_every % every
        ):
            raise ValueError(
                f"density_every must be a positive multiple of every={every} (a snapshot is "
                f"taken on a tracked step), got {density_every!r}"
            )
        self.model = model
        self.every = every
        self.k = k
        self.which = which
        self.trace = trace
        self.trace_matvecs = trace_matvecs
        self.density_every = density_every
        self.density_options: dict[str, Any] = {"num_runs": 4, "lanczos_steps": 30}
        self.density_options.update(density_options or {})
        if residuals not in ("exact", "estimate"):
            raise ValueError(f"residuals must be 'exact' or 'estimate', got {residuals!r}")
        self.tol = tol
        self.residuals: Literal["exact", "estimate"] = residuals
        self.seed = seed
        self.warm_start = warm_start
        self.eval_mode = eval_mode
        data = [batch] if loader is None else loader
        with _training_untouched(model, eval_mode):
            # built once: it reads the parameters in place on every product
            self.operator = HessianOperator(model, data, loss_fn, **operator_options)
        self.history: list[TrackRecord] = []
        self.last_result: EigenResult | None = None
        self.last_trace: TraceResult | None = None
        self._calls = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def step(self, step: int | None = None) -> TrackRecord | None:
        """Count a training step (``step``: its number; default a count of the calls) and
        compute when due. Leaves the model, its buffers, the global RNG, grad mode and
        autocast as found (NOTE [tracker leaves training untouched])."""
        if step is None:
            step = self._calls
        self._calls += 1
        if not self.due(step):
            return None
        return self.compute(step)

    def compute(self, step: int) -> TrackRecord:
        """Compute now, whatever the schedule, and append the record to ``history``."""
        op = self.operator
        before = op.num_matvecs
        t0 = time.perf_counter()
        # NOTE [tracker frees kept states]. The parameters move between two tracked steps, so
        # nothing kept by one call is valid at the next (the operator's reuse key would see it,
        # NOTE [updates that keep the version] in operators.graph_reuse). The kept state and its
        # recordings are dropped at the end of each call instead of being carried through the
        # training steps in between: the training gets that memory back (gigabytes on an LM),
        # and a call never holds the old state while it builds the new one. Compiled programs
        # are kept.
        with _training_untouched(self.model, self.eval_mode):
            v0 = self.last_result if self.warm_start else None
            # NOTE [tracker residual check]: with full reorthogonalization the Lanczos residual
            # estimates equal the true residuals in exact arithmetic, and the record keeps only
            # the eigenvalues; the exact check would cost k more products in a block of k, a
            # block that is recorded anew on every call (the kept state is freed at the end of
            # each, NOTE [tracker frees kept states]) and compiled once more on the compiled
            # engine (GPT-2 6L, H100: about 30 s at the first call)
            res = lanczos(
                op,
                k=self.k,
                which=self.which,
                tol=self.tol,
                seed=self.seed,
                v0=v0,
                residuals=self.residuals,
            )
            tr = tr_stderr = None
            if self.trace:
                tres = hutch_plus_plus(
                    op,
                    num_matvecs=self.trace_matvecs,
                    seed=self.seed,
                    sketch=self.last_trace if self.warm_start else None,
                    keep_sketch=self.warm_start,
                )
                tr, tr_stderr = tres.estimate, tres.stderr
                self.last_trace = tres if self.warm_start else None
            density = None
            if self.density_every is not None and step % self.density_every == 0:
                options = {"seed": self.seed, "num_grid_points": 2, **self.density_options}
                sd = spectral_density(op, **options)
                keep = ~torch.isnan(sd.raw_eigenvalues)
                density = {
                    "nodes": sd.raw_eigenvalues[keep].tolist(),
                    "weights": (sd.raw_weights[keep] / sd.raw_weights.shape[0]).tolist(),
                    "sigma": sd.sigma,
                }
        rec = TrackRecord(
            step=int(step),
            eigenvalues=[float(x) for x in res.eigenvalues],
            trace=tr,
            products=int(op.num_matvecs - before),
            seconds=time.perf_counter() - t0,
            density=density,
            trace_stderr=tr_stderr,
        )
        self.last_result = res
        self.history.append(rec)
        op.clear_cache()  # NOTE [tracker frees kept states]
        return rec

    def to_jsonl(self, path: str | os.PathLike[str]) -> None:
        """Write ``history`` as JSON lines, one record a line."""
        with open(path, "w") as f:
            for rec in self.history:
                f.write(json.dumps(asdict(rec)) + "\n")

    def plot(self, path: str | os.PathLike[str], lr: float | None = None) -> Any:
        """The tracked eigenvalues against step (and the trace, in a second panel, when tracked),
        written to ``path`` (matplotlib, Agg backend); returns the figure.

        The y axis fits the eigenvalues. With ``lr``, gradient descent's stability edge ``2 / lr``
        is drawn when it lies within twice the largest tracked eigenvalue, and otherwise only
        written in the corner with how far off the scale it is: drawn at ``2 / lr = 20000`` over
        eigenvalues near 10, it would press the curve flat onto the floor.
        """
        # no pyplot: a figure on its own Agg canvas changes no global matplotlib state
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from hessian_eigenthings import _plot_style as style

        if lr is not None and not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a positive number, got {lr!r}")
        if not self.history:
            raise ValueError("nothing tracked yet: call step() (or compute()) first")
        traced = [r for r in self.history if r.trace is not None]
        fig = Figure(figsize=(10 if traced else 5.5, 3.8))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 2 if traced else 1, squeeze=False)[0]
        ax = axes[0]
        steps = [r.step for r in self.history]
        k = max(len(r.eigenvalues) for r in self.history)
        for i in range(k):
            values = [
                r.eigenvalues[i] if i < len(r.eigenvalues) else math.nan for r in self.history
            ]
            label = f"λ{_subscript(i + 1)}" + (
                " (sharpness)" if i == 0 and self.which == "LA" else ""
            )
            ax.plot(
                steps,
                values,
                marker="o",
                ms=3,
                lw=1.5 if i == 0 else 1.0,
                label=label,
                color=style.EIGEN if i == 0 else None,
                alpha=1.0 if i == 0 else 0.8,
            )
        values = [v for r in self.history for v in r.eigenvalues if math.isfinite(v)]
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        if lr is not None:
            edge = 2.0 / lr
            if lo <= edge <= 2.0 * max(hi, 0.0):
                ax.axhline(edge, color=style.REFERENCE, ls="--", lw=1.0, label=f"2/lr = {edge:.4g}")
                hi = max(hi, edge)
            else:
                ax.text(
                    0.99,
                    0.02,
                    f"2/lr = {edge:g}: {edge / hi:.3g}× the top eigenvalue, off the scale"
                    if hi > 0
                    else f"2/lr = {edge:g}, off the scale",
                    transform=ax.transAxes,
                    ha="right",
                    va="bottom",
                    fontsize=style.LEGEND_FONTSIZE,
                )
        pad = 0.08 * (hi - lo) if hi > lo else 0.1 * max(abs(hi), 1e-12)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel("step")
        ax.set_ylabel("eigenvalue")
        ax.set_title(
            f"top {k} eigenvalue{'s' if k > 1 else ''}"
            if self.which == "LA"
            else f"{k} largest |λ|"
        )
        style.finish(ax)
        if traced:
            ax = axes[1]
            t = [r.step for r in traced]
            est = [float(r.trace) for r in traced]  # type: ignore[arg-type]
            ax.plot(t, est, marker="o", ms=3, color=style.MEASURED, label="Hutch++ estimate")
            err = [r.trace_stderr or 0.0 for r in traced]
            ax.fill_between(
                t,
                [e - s for e, s in zip(est, err, strict=True)],
                [e + s for e, s in zip(est, err, strict=True)],
                color=style.MEASURED,
                alpha=0.2,
                label="± stderr",
            )
            ax.set_xlabel("step")
            ax.set_ylabel("trace")
            ax.set_title(f"trace ({self.trace_matvecs} products)")
            style.finish(ax)
        fig.suptitle(f"Hessian curvature along training (every {self.every} steps)", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return fig


def _subscript(i: int) -> str:
    return str(i).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))
