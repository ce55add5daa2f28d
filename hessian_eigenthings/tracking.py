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

    def plot(self, path: str | os.PathLike[str], lr: float | None = None) -> None:
        """Sharpness (top eigenvalue) against step, with the ``2 / lr`` line of gradient descent
        when ``lr`` is given; written to ``path`` (matplotlib, Agg backend)."""
        # no pyplot: a figure on its own Agg canvas changes no global matplotlib state
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5, 3.2))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        steps = [r.step for r in self.history]
        ax.plot(steps, [r.eigenvalues[0] for r in self.history], marker="o", label="top eigenvalue")
        if lr is not None:
            if not (lr > 0 and math.isfinite(lr)):
                raise ValueError(f"lr must be a positive number, got {lr!r}")
            ax.axhline(2.0 / lr, color="k", linestyle="--", label=f"2/lr = {2.0 / lr:g}")
        ax.set_xlabel("step")
        ax.set_ylabel("sharpness")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
