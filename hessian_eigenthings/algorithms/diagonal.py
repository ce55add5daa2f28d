"""Stochastic estimation of ``diag(A)``: Hutchinson, Diag++ and XDiag.

Math. For probes ``z`` with independent zero-mean unit-variance entries,
``E[z ⊙ A z] = diag(A)`` (Bekas, Kokiopoulou & Saad, 2007); the error of
entry ``i`` is ``sqrt(Σ_{j≠i} A_ij² / s)`` for Rademacher probes. Diag++
(Baston & Nakatsukasa, 2022) first sketches ``Q = orth(A S)``, takes
``diag(QQᵀA) = Σ_j Q_j ⊙ (A Q_j)`` exactly and estimates only the rest,
``diag((I − QQᵀ) A)``, with Hutchinson probes: unbiased, and much more
accurate when the spectrum decays, since the off-diagonal mass left in
``(I − QQᵀ)A`` is small.

XDiag (Epperly, Tropp & Webber, 2024) is Diag++ with every probe reused,
as XTrace is for the trace: ``s = num_matvecs / 2`` probes ``ωᵢ``,
``Y = AΩ``; the *i*-th leave-one-out estimate sketches with the other
probes, ``P₍ᵢ₎ = orth(Y₋ᵢ)``, and is
``diag(P₍ᵢ₎A) + ωᵢ ⊙ (I − P₍ᵢ₎)Aωᵢ``, unbiased; the estimate is the mean of
the ``s`` of them and the stderr their elementwise spread over ``sqrt(s)``.
One basis ``Q = orth(Y)`` serves all ``s`` projections (see NOTE
[leave-one-out basis] in ``trace``); exact when ``rank(A) < s``.

Cost: ``num_matvecs`` products in blocks through ``op.matmat``; memory
``O((block_size + num_matvecs/3) · n)`` plus three running sums of length n
(Diag++), about ``4 · num_matvecs · n`` numbers at the peak (XDiag).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.algorithms._common import (
    apply_rows,
    device_free_bytes,
    global_size,
    non_finite_error,
    probe_setup,
    progress_bar,
    random_rows,
    rows_that_fit,
)
from hessian_eigenthings.algorithms.result import DiagonalResult
from hessian_eigenthings.algorithms.trace import (
    _blocks,
    check_exchangeable_budget,
    leave_one_out_sketch,
    sketch_range,
)
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = ["diagonal"]


def diagonal(
    op: CurvatureOperator,
    *,
    num_matvecs: int = 100,
    method: Literal["diag++", "xdiag", "hutchinson", "exact"] = "diag++",
    distribution: Literal["rademacher", "gaussian"] = "rademacher",
    seed: int | None = None,
    block_size: int | None = None,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    progress: bool | None = None,
) -> DiagonalResult:
    """Estimate ``diag(A)`` with ``num_matvecs`` products.

    ``method="diag++"`` splits the budget in thirds (sketch, ``A Q``,
    probes; needs at least 3); ``"xdiag"`` uses half the budget for probes
    that serve both as sketch and as Hutchinson probes, half for ``A Q``
    (needs an even budget, at least 4; fewer products when ``rank(AΩ)`` is
    below the probe count, where the answer is exact); ``"hutchinson"``
    spends it all on probes. ``stderr`` is the elementwise standard error of
    the probe part (``inf`` with a single probe); for XDiag it is the spread
    of the exchangeable leave-one-out estimates over ``sqrt(s)``.

    Which estimator when: the same as for :func:`trace`. XDiag beats Diag++
    at equal budget when the spectrum decays and products dominate the
    cost; Hutchinson is best for diagonally dominant operators, where a
    range sketch buys nothing and ``block_size · n`` memory suffices.

    ``method="exact"``: the exact diagonal of a
    :class:`~hessian_eigenthings.operators.GGNOperator` (with ``mc_samples=k``: of the
    Monte-Carlo Fisher the operator represents, the same draws) or an
    :class:`~hessian_eigenthings.operators.EmpiricalFisherOperator`, by backpropagating the
    columns of a square root of the loss Hessian sample by sample (NOTE [exact diagonal] in
    ``operators.sandwich``): about ``C`` backward passes per sample for ``C`` outputs, no
    products (``num_matvecs=0``, ``stderr`` zero); the probe arguments do not apply.
    """
    if method not in ("diag++", "xdiag", "hutchinson", "exact"):
        raise ValueError(
            f"method must be 'diag++', 'xdiag', 'hutchinson' or 'exact', got {method!r}"
        )
    if method == "exact":
        exact_fn = getattr(op, "exact_diagonal", None)
        if exact_fn is None:
            raise TypeError(
                f"method='exact' needs a GGNOperator or EmpiricalFisherOperator, got {type(op).__name__}; "
                "use method='xdiag' (or 'diag++', 'hutchinson') for any operator"
            )
        est = exact_fn()
        return DiagonalResult(estimate=est, stderr=torch.zeros_like(est), num_matvecs=0)
    s = 0
    if method == "xdiag":
        s = check_exchangeable_budget(num_matvecs, "xdiag")
        num_matvecs = 2 * s
    else:
        num_matvecs = check_count(
            "num_matvecs", num_matvecs, minimum=3 if method == "diag++" else 1
        )
    block_size = check_count("block_size", block_size, allow_none=True)
    op, backend, gen, wd = probe_setup(op, backend, distribution, seed, precision)
    op.expect_products(num_matvecs)
    if method == "xdiag":
        return _xdiag(op, s, gen, distribution, block_size, backend, wd, progress)
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
                del AQ  # (q, n): the probes below need the room
            probes = num_matvecs - spent
            if Q.shape[0] >= global_size(op):  # the sketch spans everything: exact
                return DiagonalResult(
                    estimate=exact, stderr=torch.zeros_like(exact), num_matvecs=spent
                )
        total = torch.zeros(n, dtype=acc, device=op.device)
        total_sq = torch.zeros(n, dtype=acc, device=op.device)
        for b in _blocks(probes, block_size, rows_that_fit(op, wd, device_free_bytes(op.device))):
            Z = random_rows(b, n, gen, device=op.device, dtype=wd, distribution=distribution)
            AZ = apply_rows(op, Z)
            if Q is not None and Q.shape[0]:
                # (I - QQᵀ) A z, one new block (not in place: a user's operator may return its input)
                AZ = torch.addmm(AZ, backend.inner_rows(AZ, Q), Q, alpha=-1)
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


def _xdiag(
    op: CurvatureOperator,
    s: int,
    gen: torch.Generator,
    distribution: str,
    block_size: int | None,
    backend: LinAlgBackend,
    wd: torch.dtype,
    progress: bool | None,
) -> DiagonalResult:
    with progress_bar(2 * s, "diagonal (xdiag)", progress) as bar:
        sk = leave_one_out_sketch(
            op,
            s,
            gen,
            distribution=distribution,
            block_size=block_size,
            backend=backend,
            wd=wd,
            bar=bar,
        )
    Q, Z, Om, Y = sk.basis, sk.basis_images, sk.probes, sk.images
    spent = s + Q.shape[0]
    R = sk.coeffs.to(device=op.device, dtype=wd)
    S = sk.removed.to(device=op.device, dtype=wd)
    c = (sk.removed * sk.coeffs).sum(dim=0).to(device=op.device, dtype=wd)  # sᵢ · Q yᵢ
    Qs = S.T @ Q  # (s, n): q̂ᵢ, the direction lost when ωᵢ is left out
    # diag(P₍ᵢ₎A) = diag(QᵀQA) − q̂ᵢ ⊙ Aq̂ᵢ;  (I − P₍ᵢ₎)yᵢ = yᵢ − QᵀQyᵢ + q̂ᵢ (q̂ᵢ · yᵢ)
    samples = (Q * Z).sum(dim=0) - Qs * (S.T @ Z) + Om * (Y - R.T @ Q + c.unsqueeze(1) * Qs)
    acc = torch.float64 if wd == torch.float64 else torch.float32
    samples = samples.to(acc)
    est = samples.mean(dim=0)
    stderr = samples.std(dim=0, unbiased=True) / math.sqrt(s)
    if not bool(torch.isfinite(est).all()):
        raise non_finite_error("xdiag", 1)
    return DiagonalResult(estimate=est, stderr=stderr, num_matvecs=spent)
