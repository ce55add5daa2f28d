"""Stochastic estimation of ``diag(A)``: Hutchinson and Diag++.

Math. For probes ``z`` with independent zero-mean unit-variance entries,
``E[z ⊙ A z] = diag(A)`` (Bekas, Kokiopoulou & Saad, 2007); the error of
entry ``i`` is ``sqrt(Σ_{j≠i} A_ij² / s)`` for Rademacher probes. Diag++
(Baston & Nakatsukasa, 2022) first sketches ``Q = orth(A S)``, takes
``diag(QQᵀA) = Σ_j Q_j ⊙ (A Q_j)`` exactly and estimates only the rest,
``diag((I − QQᵀ) A)``, with Hutchinson probes: unbiased, and much more
accurate when the spectrum decays, since the off-diagonal mass left in
``(I − QQᵀ)A`` is small.

Cost: ``num_matvecs`` products in blocks through ``op.matmat``; memory
``O((block_size + num_matvecs/3) · n)`` plus three running sums of length n.
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
    progress_bar,
    random_rows,
    work_dtype,
)
from hessian_eigenthings.algorithms.result import DiagonalResult
from hessian_eigenthings.algorithms.trace import _blocks, _check_count, sketch_range
from hessian_eigenthings.linalg import LinAlgBackend, default_backend
from hessian_eigenthings.operators.base import CurvatureOperator

__all__ = ["diagonal"]


def diagonal(
    op: CurvatureOperator,
    *,
    num_matvecs: int = 100,
    method: Literal["diag++", "hutchinson"] = "diag++",
    distribution: Literal["rademacher", "gaussian"] = "rademacher",
    seed: int | None = None,
    block_size: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
) -> DiagonalResult:
    """Estimate ``diag(A)`` with ``num_matvecs`` products.

    ``method="diag++"`` splits the budget in thirds (sketch, ``A Q``,
    probes; needs at least 3); ``"hutchinson"`` spends it all on probes.
    ``stderr`` is the elementwise standard error of the probe part (``inf``
    with a single probe).
    """
    op = check_operator(op)
    backend = default_backend(backend)
    check_distribution(distribution)
    if method not in ("diag++", "hutchinson"):
        raise ValueError(f"method must be 'diag++' or 'hutchinson', got {method!r}")
    _check_count("num_matvecs", num_matvecs, 3 if method == "diag++" else 1)
    gen = make_generator(seed, backend)
    wd = work_dtype(op, precision)
    acc = torch.float64 if wd == torch.float64 else torch.float32
    n = op.size
    exact = torch.zeros(n, dtype=acc, device=op.device)
    Q = None
    spent = 0
    with progress_bar(num_matvecs, f"diagonal ({method})", progress) as bar:
        probes = num_matvecs
        if method == "diag++":
            s = num_matvecs // 3
            Q = sketch_range(op, s, gen, distribution=distribution, backend=backend, wd=wd, bar=bar)
            spent += s
            if Q.shape[0]:
                AQ = apply_rows(op, Q)
                bar.update(Q.shape[0])
                spent += Q.shape[0]
                exact = (Q * AQ).sum(dim=0).to(acc)
            probes = num_matvecs - spent
            if Q.shape[0] >= n:  # the sketch spans everything: exact
                return DiagonalResult(
                    estimate=exact, stderr=torch.zeros_like(exact), num_matvecs=spent
                )
        total = torch.zeros(n, dtype=acc, device=op.device)
        total_sq = torch.zeros(n, dtype=acc, device=op.device)
        for b in _blocks(probes, block_size):
            Z = random_rows(b, n, gen, device=op.device, dtype=wd, distribution=distribution)
            AZ = apply_rows(op, Z)
            if Q is not None and Q.shape[0]:
                AZ = AZ - backend.inner_rows(AZ, Q) @ Q  # (I - QQᵀ) A z
            samples = (Z * AZ).to(acc)
            total += samples.sum(dim=0)
            total_sq += (samples * samples).sum(dim=0)
            spent += b
            bar.update(b)
    mean = total / probes
    if probes > 1:
        var = (total_sq - probes * mean * mean).clamp_min(0) / (probes - 1)
        stderr = (var / probes).sqrt()
    else:
        stderr = torch.full_like(mean, math.inf)
    est = exact + mean
    if not bool(torch.isfinite(est).all()):
        raise non_finite_error("diagonal probes", 1)
    return DiagonalResult(estimate=est, stderr=stderr, num_matvecs=spent)
