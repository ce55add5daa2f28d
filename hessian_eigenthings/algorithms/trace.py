"""Stochastic trace estimation: Hutchinson and Hutch++.

Math. For probes ``z`` with ``E[z zᵀ] = I`` (Rademacher or Gaussian),
``E[zᵀ A z] = tr(A)`` (Hutchinson); the standard error falls as
``1/sqrt(s)`` with ``s`` probes, and its variance is ``2||A||_F²``
(Gaussian) or ``2 Σ_{i≠j} A_ij²`` (Rademacher). Hutch++ (Meyer, Musco,
Musco & Woodruff, 2021) spends a third of the budget on a sketch
``Q = orth(A S)`` of the top eigenspace, whose trace ``tr(QᵀAQ)`` it takes
exactly, and Hutchinson's estimate on the deflated rest
``(I − QQᵀ) A (I − QQᵀ)``; error ``O(1/m)`` instead of ``O(1/sqrt(m))`` for
matrices with decaying spectra, unbiased in all cases.

Cost: ``num_matvecs`` products, in blocks of ``block_size`` through
``op.matmat``; memory ``O(block_size · n)`` for Hutchinson and
``O(num_matvecs/3 · n)`` for the Hutch++ sketch.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from hessian_eigenthings.algorithms._common import (
    apply_rows,
    check_distribution,
    check_operator,
    make_generator,
    non_finite_error,
    orthonormalize_rows,
    progress_bar,
    random_rows,
    row_dots,
    work_dtype,
)
from hessian_eigenthings.algorithms.result import TraceResult
from hessian_eigenthings.linalg import LinAlgBackend, default_backend
from hessian_eigenthings.operators.base import CurvatureOperator

__all__ = ["hutch_plus_plus", "hutchinson", "trace"]

Distribution = Literal["rademacher", "gaussian"]

_DEFAULT_BLOCK = 32


def _check_count(name: str, value: int, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _blocks(total: int, block_size: int | None) -> list[int]:
    bs = block_size if block_size is not None else min(total, _DEFAULT_BLOCK)
    if bs < 1:
        raise ValueError(f"block_size must be >= 1, got {bs}")
    return [min(bs, total - s) for s in range(0, total, bs)]


def _quadratic_forms(
    op: CurvatureOperator,
    count: int,
    gen: torch.Generator,
    *,
    distribution: str,
    block_size: int | None,
    backend: LinAlgBackend,
    wd: torch.dtype,
    Q: torch.Tensor | None,
    bar: object,
) -> torch.Tensor:
    """``zᵢᵀ P A P zᵢ`` for ``count`` probes, ``P = I − QQᵀ`` (or ``I``); float64 on the CPU."""
    out = []
    for b in _blocks(count, block_size):
        Z = random_rows(b, op.size, gen, device=op.device, dtype=wd, distribution=distribution)
        if Q is not None and Q.shape[0]:
            Z = Z - backend.inner_rows(Z, Q) @ Q
        out.append(row_dots(backend, Z, apply_rows(op, Z)))
        bar.update(b)  # type: ignore[attr-defined]
    vals = torch.cat(out).to("cpu", torch.float64)
    if not bool(torch.isfinite(vals).all()):
        raise non_finite_error("trace probes", 1)
    return vals


def sketch_range(
    op: CurvatureOperator,
    count: int,
    gen: torch.Generator,
    *,
    distribution: str,
    backend: LinAlgBackend,
    wd: torch.dtype,
    bar: object,
) -> torch.Tensor:
    """``Q = orth(A S)`` for ``count`` random probes ``S``: rows ``(q, n)``, ``q <= count``."""
    S = random_rows(count, op.size, gen, device=op.device, dtype=wd, distribution=distribution)
    AS = apply_rows(op, S)
    bar.update(count)  # type: ignore[attr-defined]
    if not bool(torch.isfinite(AS).all()):
        raise non_finite_error("range sketch", 1)
    return orthonormalize_rows(AS, backend)


def _result(samples: torch.Tensor) -> TraceResult:
    s = samples.shape[0]
    est = float(samples.mean())
    stderr = float(samples.std(unbiased=True)) / math.sqrt(s) if s > 1 else float("inf")
    return TraceResult(estimate=est, stderr=stderr, samples=samples)


def hutchinson(
    op: CurvatureOperator,
    *,
    num_samples: int = 100,
    distribution: Distribution = "rademacher",
    seed: int | None = None,
    block_size: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
) -> TraceResult:
    """Hutchinson's estimate of ``tr(A)`` from ``num_samples`` probes (one product each)."""
    op = check_operator(op)
    backend = default_backend(backend)
    _check_count("num_samples", num_samples, 1)
    check_distribution(distribution)
    gen = make_generator(seed, backend)
    wd = work_dtype(op, precision)
    with progress_bar(num_samples, "hutchinson", progress) as bar:
        vals = _quadratic_forms(
            op,
            num_samples,
            gen,
            distribution=distribution,
            block_size=block_size,
            backend=backend,
            wd=wd,
            Q=None,
            bar=bar,
        )
    return _result(vals)


def hutch_plus_plus(
    op: CurvatureOperator,
    *,
    num_matvecs: int = 100,
    distribution: Distribution = "rademacher",
    seed: int | None = None,
    block_size: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
) -> TraceResult:
    """Hutch++ estimate of ``tr(A)`` with ``num_matvecs`` products (at least 3).

    Budget split: ``s = num_matvecs // 3`` for the sketch, ``s`` for ``A Q``,
    the rest for Hutchinson on the deflated operator. ``samples`` holds
    ``tr(QᵀAQ) + zᵢᵀ P A P zᵢ`` per probe (their mean is the estimate; the
    stderr is the probes' conditional standard error given the sketch).
    """
    op = check_operator(op)
    backend = default_backend(backend)
    _check_count("num_matvecs", num_matvecs, 3)
    check_distribution(distribution)
    gen = make_generator(seed, backend)
    wd = work_dtype(op, precision)
    s = num_matvecs // 3
    with progress_bar(num_matvecs, "hutch++", progress) as bar:
        Q = sketch_range(op, s, gen, distribution=distribution, backend=backend, wd=wd, bar=bar)
        q = Q.shape[0]
        low = torch.zeros((), dtype=torch.float64)
        if q:
            AQ = apply_rows(op, Q)
            bar.update(q)
            low = row_dots(backend, Q, AQ).to("cpu", torch.float64).sum()
        g = num_matvecs - s - q
        if q >= op.size:  # the sketch spans everything: the trace is exact
            return TraceResult(estimate=float(low), stderr=0.0, samples=low.reshape(1))
        vals = _quadratic_forms(
            op,
            g,
            gen,
            distribution=distribution,
            block_size=block_size,
            backend=backend,
            wd=wd,
            Q=Q,
            bar=bar,
        )
    return _result(low + vals)


def trace(
    op: CurvatureOperator,
    *,
    num_matvecs: int = 100,
    method: Literal["hutch++", "hutchinson"] = "hutch++",
    distribution: Distribution = "rademacher",
    seed: int | None = None,
    block_size: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
) -> TraceResult:
    """Estimate ``tr(A)`` with a budget of ``num_matvecs`` products.

    ``method="hutch++"`` (default) is never much worse than Hutchinson and
    far better when the spectrum decays (Hessians of trained networks);
    ``"hutchinson"`` keeps every probe independent (simplest error bars).
    """
    if method == "hutch++":
        return hutch_plus_plus(
            op,
            num_matvecs=num_matvecs,
            distribution=distribution,
            seed=seed,
            block_size=block_size,
            backend=backend,
            precision=precision,
            progress=progress,
        )
    if method == "hutchinson":
        return hutchinson(
            op,
            num_samples=num_matvecs,
            distribution=distribution,
            seed=seed,
            block_size=block_size,
            backend=backend,
            precision=precision,
            progress=progress,
        )
    raise ValueError(f"method must be 'hutch++' or 'hutchinson', got {method!r}")
