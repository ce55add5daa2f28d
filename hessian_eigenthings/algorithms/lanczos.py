"""Restarted Lanczos for a few extreme eigenpairs of a symmetric operator.

Math. Lanczos builds an orthonormal basis ``V`` of the Krylov space
``span{v, Av, A²v, ...}`` in which ``T = Vᵀ A V`` is (block) tridiagonal;
the eigenpairs ``(θ, V s)`` of ``T`` (Ritz pairs) approximate the extreme
eigenpairs of ``A``. Because ``A V = V T + R_last`` with the residual block
known, the residual of every Ritz pair is known without a product:
``||A V s - θ V s|| = ||R S_last s||`` (``|β s_m|`` for one vector).

When the basis reaches ``ncv`` vectors, it is restarted *thick* (Wu & Simon's
TRLan, mathematically the same as ARPACK's implicit restart with exact
shifts): the ``l`` most wanted Ritz vectors are kept, with ``T`` restarted as
``diag(θ)`` bordered by their couplings to the residual block, and the
iteration continues from the residual block.

Implementation. The basis lives in one preallocated ``(ncv + b, n)`` tensor
in the working dtype; each step applies the operator once (``b`` products for
a block of ``b``), reorthogonalizes against the whole basis by classical
Gram-Schmidt twice, both as matrix products, and synchronizes with the host
once to read the new coefficients (the ``T`` matrix is small and lives on the
host in float64). Ritz convergence is checked within a restart cycle, on a
schedule that predicts from the residual estimates when the wanted pairs will
meet ``tol`` (NOTE [ritz check schedule]), so the solver stops at the step
where they do instead of at the end of a restart cycle, without a Ritz
eigensolve on every step.

Cost: ``max_iter`` products at most; the residuals come from the products made
(``residuals="recorded"``, NOTE [recorded residuals]), or cost ``k`` more products
(``residuals="exact"``); ``O(ncv · n)`` flops per product for
reorthogonalization; memory ``(ncv + b) · n`` working-dtype numbers plus a
restart buffer of ``l · n``.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.algorithms._checkpoint import (
    checkpoint_path,
    load_checkpoint,
    remove_checkpoint,
    save_checkpoint,
)
from hessian_eigenthings.algorithms._common import (
    HOST_ARITHMETIC_MAX_NUMEL,
    apply_rows,
    check_gap,
    check_k,
    check_operator,
    global_size,
    host_arithmetic,
    host_matvec,
    householder_ok,
    make_generator,
    non_finite_error,
    operator_backend,
    orthonormalize_rows,
    progress_bar,
    random_rows,
    rounding_level,
    row_dots,
    warm_start_rows,
    work_dtype,
)
from hessian_eigenthings.algorithms.result import EigenResult, LanczosTridiag, warn_convergence
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.base import CurvatureOperator

Which = Literal["LM", "LA", "SA"]

__all__ = ["check_symmetry", "lanczos", "lanczos_tridiagonal"]


def _is_warm_basis(v0: object, n: int, b: int) -> bool:
    """Whether ``v0`` is a warm start (a previous result, or a basis of ``p != b`` vectors)
    rather than the start vector / block of the 1.0 API."""
    if isinstance(v0, EigenResult):
        return True
    if not isinstance(v0, torch.Tensor) or v0.dim() != 2:
        return False
    if v0.shape == (b, n):
        return False
    return v0.shape[1] == n or v0.shape[0] == n


def _order(theta: np.ndarray, which: str) -> np.ndarray:
    """Indices of ``theta`` from most to least wanted."""
    if which == "LM":
        return np.argsort(-np.abs(theta), kind="stable")
    if which == "LA":
        return np.argsort(-theta, kind="stable")
    return np.argsort(theta, kind="stable")


def check_symmetry(
    op: CurvatureOperator,
    *,
    seed: int | None = None,
    backend: LinAlgBackend | None = None,
    rtol: float | None = None,
) -> float:
    """Compare ``<u, Av>`` with ``<Au, v>`` for two random vectors (2 products).

    Returns the relative asymmetry; raises ``ValueError`` when it exceeds
    ``rtol`` (default: ``100 · eps`` of the operator's dtype, at most 0.1).
    """
    op = check_operator(op)
    backend = operator_backend(op, backend)
    gen = make_generator(seed, backend)
    wd = work_dtype(op, None)
    X = random_rows(2, op.size, gen, device=op.device, dtype=wd)
    AX = apply_rows(op, X)
    a = backend.dot(X[0], AX[1])
    b = backend.dot(AX[0], X[1])
    scale = backend.norm(X[0]) * backend.norm(AX[1]) + backend.norm(AX[0]) * backend.norm(X[1])
    rel = float((a - b).abs() / scale.clamp_min(torch.finfo(wd).tiny))
    limit = rtol if rtol is not None else min(0.1, 100 * torch.finfo(op.dtype).eps)
    if not math.isfinite(rel) or rel > limit:
        raise ValueError(
            f"the operator is not symmetric: <u, Av> and <Au, v> differ by {rel:.2e} relative "
            f"(allowed {limit:.1e}). Curvature algorithms need a symmetric operator; "
            + (
                "; ".join(op.inconsistency_causes())
                or "check the matvec function (e.g. a missing transpose, or data that changes between products)"
            )
        )
    return rel


def _block_qr(W: torch.Tensor, backend: LinAlgBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """``W (b, n) = Rᵀ Q`` with orthonormal rows ``Q``; no host sync.

    Single device: Householder QR. Other backends, and blocks past 32-bit
    indexing: Cholesky QR twice through the backend's Gram matrix. A rank-deficient block shows up as a tiny or
    non-finite diagonal of ``R``, which the caller checks on the host.
    """
    b = W.shape[0]
    if b == 1:
        beta = row_dots(backend, W, W).sqrt()
        return W / beta.clamp_min(torch.finfo(W.dtype).tiny), beta.view(1, 1)
    if householder_ok(W, backend):
        Qc, R = torch.linalg.qr(W.T)
        return Qc.T, R
    Q = W
    R = torch.eye(b, dtype=W.dtype, device=W.device)
    for _ in range(2):
        L, _info = torch.linalg.cholesky_ex(backend.inner_rows(Q, Q))
        Q = torch.linalg.solve_triangular(L, Q, upper=False)
        R = L.T @ R
    return Q, R


def lanczos(
    op: CurvatureOperator,
    *,
    k: int = 10,
    max_iter: int | None = None,
    tol: float = 1e-4,
    reorthogonalize: bool | None = None,
    which: Which = "LM",
    seed: int | None = None,
    backend: LinAlgBackend | None = None,
    ncv: int | None = None,
    block_size: int = 1,
    v0: torch.Tensor | EigenResult | None = None,
    precision: torch.dtype | None = None,
    residuals: Literal["recorded", "exact", "estimate"] = "recorded",
    check_symmetric: bool = False,
    progress: bool | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
) -> EigenResult:
    """Top-``k`` eigenpairs of a symmetric operator by thick-restart Lanczos.

    Args:
        k: number of eigenpairs.
        max_iter: budget of operator products (a block of ``b`` counts
            ``b``); default ``max(1000, 30 · ncv)`` (``residuals="exact"``
            costs ``k`` more at the end). A ``max_iter`` you pass
            bounds every product (``result.iterations <= max_iter``, as in the
            1.0 alpha): see NOTE [explicit lanczos budget].
        tol: a pair is converged when ``||A v - θ v|| <= max(tol · |θ|, floor)``, the
            floor being the residual rounding alone makes: ``rounding_level`` of the
            dtypes (float32 about 1.2e-5, float64 2.2e-14) times the largest ``|θ|``
            seen. The result carries both (``result.tol``, ``result.residual_floor``);
            see NOTE [convergence rule] in ``result``.
        reorthogonalize: ``None``/``True``: full reorthogonalization (classical
            Gram-Schmidt twice). ``False``: only against the previous block
            (and the kept vectors after a restart): less arithmetic, but
            spurious copies of converged eigenvalues can appear.
        which: ``"LM"`` largest magnitude, ``"LA"`` largest algebraic,
            ``"SA"`` smallest algebraic. Results come most wanted first:
            ``|θ|`` descending, ``θ`` descending, ``θ`` ascending respectively.
        seed: seed of the start vector (local generator; reproducible).
        ncv: Krylov basis size before a restart (ARPACK's ``ncv``); default
            ``min(n, max(2k + 1, 20, k + 2b, 10b))`` (a block
            basis needs depth: about ten blocks).
        block_size: ``b > 1`` runs block Lanczos: each step applies the
            operator to ``b`` vectors in one ``op @ V`` pass. Measured on
            top-10 problems (``benchmarks/bench_block_solvers.py``, see
            ``benchmarks/RESULTS.md``): ``b = 4`` / ``8`` spend 1.3-2.2x the
            products of ``b = 1`` and 2-4x fewer passes. Use ``b = 4`` or
            ``8`` when a pass over ``b`` vectors costs little more than one
            product *and* passes dominate the vector arithmetic: model
            Hessians on a GPU, where a block rides on one forward/backward
            (``b = 8`` was 1.2-2.6x faster there). Keep ``b = 1`` when a
            block costs about ``b`` products (diagonal or sparse operators,
            small models on a CPU). When the wanted eigenvalues border a
            dense bulk, blocks need 2.4-3x the products: ``b = 8`` still won
            when passes dominated, ``b = 4`` did not; give ``b = 8`` a larger
            ``max_iter``. A block also finds exactly repeated eigenvalues (multiplicity up
            to ``b``), which ``b = 1`` separates only through rounding. When
            ``ncv + b > n`` it falls back to ``b = 1``.
        v0: start vector ``(n,)`` or start block ``(b, n)``; random otherwise.
            A warm start: the previous ``EigenResult`` or a basis ``(p, n)`` /
            ``(n, p)`` of its eigenvectors; the start is their sum (``b``
            sums for a block). Worth it when the operator changed little since
            (parameters moved little along training): about half the products
            at a change of 1e-5 of its norm, 10-40% fewer at 1e-3; the answer
            is that of a cold start either way. Zero or non-finite vectors warn
            and start cold; a shape that does not fit raises. See NOTE [warm
            starts] in ``_common``.
        precision: working dtype of the basis and reductions, see NOTE
            [mixed precision] in ``_common``; products run in ``op.dtype``.
        residuals: ``"recorded"`` (default) gives ``||A v - θ v||`` from the products the
            iteration made, at no product: each product's projections onto the whole basis
            are kept (a small host matrix), so the residual includes whatever of the
            products the symmetric projection ignores (asymmetry, inconsistent products);
            it equals a recomputation up to rounding, and bounds it from above where thick
            restarts dropped parts of products (NOTE [recorded residuals]). With
            ``reorthogonalize=False`` the projections are partial and it means
            ``"exact"``. ``"exact"`` recomputes ``||A v - θ v||`` with one block product of
            the ``k`` vectors (``k`` products); ``"estimate"`` reports the Lanczos estimate
            ``||R s_last||`` (equal in exact arithmetic for a consistent operator).
        check_symmetric: spend 2 products checking that ``op`` is symmetric.
        progress: ``True`` a tqdm bar, ``False`` nothing; ``None`` a bar on a terminal or in
            Jupyter, elsewhere a log line on stderr every 30 s of a long run.
        checkpoint: a file to save the iteration to and to resume from (NOTE [resumable
            lanczos]): a call that finds the file continues where the call that wrote it
            stopped (an exception, Ctrl-C, a killed job) and returns what an uninterrupted
            call with the same arguments returns, bit for bit (eigenpairs, residuals,
            ``iterations``, ``converged``), spending only the remaining products. A file
            written with other arguments is refused, naming them. A finished call deletes the
            file, so a loop that reuses one path (along training) never resumes a finished
            solve of an older operator. With a sharded backend, give each rank its own file.
        checkpoint_every: save after every this many products (rounded up to a step);
            default: at each thick restart, when the basis is smallest (``k`` to ``ncv`` vectors
            plus a block; a run that converges within its first basis is not saved then). A
            save writes the kept basis, ``O(ncv · n)`` numbers at most.

    Returns an :class:`EigenResult` (most wanted first). Warns
    :class:`ConvergenceWarning` when the budget ends before all ``k`` pairs
    converge. When the Krylov space is exhausted (small ``n`` or an invariant
    subspace) the answer is exact.
    """
    op = check_operator(op)
    backend = operator_backend(op, backend)
    n = global_size(op)  # caps (k, ncv, exhaustion) use the whole length
    n_local = op.size  # vectors are this rank's shard
    check_k(k, n)
    if which not in ("LM", "LA", "SA"):
        raise ValueError(f"which must be 'LM', 'LA' or 'SA', got {which!r}")
    if residuals not in ("recorded", "exact", "estimate"):
        raise ValueError(f"residuals must be 'recorded', 'exact' or 'estimate', got {residuals!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not (tol >= 0):
        raise ValueError(f"tol must be >= 0, got {tol}")
    b = block_size
    # NOTE [explicit lanczos budget]
    # The 1.0 alpha's max_iter counted Lanczos steps and ran them in one basis, so
    # max_iter = n gave the exact spectrum and result.iterations never exceeded max_iter.
    # A budget passed explicitly keeps both. When it covers the whole space (max_iter >= n)
    # and an n x n basis is small (<= 256 MiB), the basis is the whole space (no restart:
    # exact after n products). The k products of the exact residual check come out of the
    # budget: the iteration gets max_iter - k, unless that would stop it short of what it
    # needs (k + b products, or the whole space when the budget covers it); then it gets all
    # of max_iter and the Lanczos residual estimates are reported (equal in exact
    # arithmetic; zero once the space is exhausted). The default budget (None) is for the
    # iteration alone, and the residual check comes on top. The default residuals
    # ("recorded", NOTE [recorded residuals]) cost no product: the whole budget is the iteration's.
    max_iter = check_count("max_iter", max_iter, allow_none=True)
    ncv = check_count("ncv", ncv, allow_none=True)
    explicit_budget = max_iter is not None
    itemsize = torch.empty((), dtype=work_dtype(op, precision)).element_size()
    if ncv is None and max_iter is not None and max_iter >= n and n * n * itemsize <= 2**28:
        ncv = n
    if ncv is None:
        ncv = max(2 * k + 1, 20, k + 2 * b, 10 * b)
    ncv = min(int(ncv), n)
    if b > 1 and ncv + b > n:
        b = 1  # the whole space fits in the basis: plain Lanczos is exact and cheaper
    if ncv < n and ncv < k + b:
        raise ValueError(
            f"ncv={ncv} must be at least k + block_size = {k + b} (or the operator size {n})"
        )
    if max_iter is None:
        max_iter = max(1000, 30 * ncv)
    full = reorthogonalize is None or bool(reorthogonalize)
    if residuals == "recorded" and not full:
        residuals = "exact"  # partial projections record partial products
    iteration_budget = max_iter
    if explicit_budget and residuals == "exact":  # See NOTE [explicit lanczos budget]
        needs = n if max_iter >= n else min(n, k + b)
        if max_iter - k >= needs:
            iteration_budget = max_iter - k
        else:
            residuals = "estimate"
    if max_iter < min(n, k + b):
        raise ValueError(
            f"max_iter={max_iter} products cannot give k={k} eigenpairs; use at least {min(n, k + b)} "
            f"(max_iter counts operator products, not restarts)"
        )
    checkpoint_every = check_count("checkpoint_every", checkpoint_every, allow_none=True)
    path = checkpoint_path(checkpoint)
    if checkpoint_every is not None and path is None:
        raise ValueError(
            "checkpoint_every is given without checkpoint= (a file to save the iteration to)"
        )
    resuming = path is not None and path.exists()
    op.expect_products(min(max_iter, 3 * ncv))  # a typical run: a few restarts of the basis
    if check_symmetric and not resuming:  # the call that wrote the checkpoint checked
        check_symmetry(op, seed=seed, backend=backend)

    wd = work_dtype(op, precision)
    device = op.device
    gen = make_generator(seed, backend)

    m = ncv
    V = torch.empty(m + b, n_local, dtype=wd, device=device)
    T = np.zeros((m + b, m + b))
    # See NOTE [recorded residuals]: every product's projections (Hf) and a bound of the
    # parts of products that restarts dropped (lost[0])
    Hf = np.zeros((m + b, m + b))
    lost = np.zeros(1)

    X0 = None
    if v0 is not None and _is_warm_basis(v0, n_local, b):
        # a previous result or a basis of p != b vectors: See NOTE [warm starts]
        Y = warm_start_rows(v0, n_local, "v0")
        if Y is not None:
            Y = Y.to(device=device, dtype=wd)
            # row i of the start block sums the vectors i, i + b, i + 2b, ... (all of them for b = 1)
            G = torch.zeros(b, Y.shape[0], dtype=wd, device=device)
            G[torch.arange(Y.shape[0]) % b, torch.arange(Y.shape[0])] = 1.0
            X0 = G @ Y
    elif v0 is not None:
        if not isinstance(v0, torch.Tensor):
            raise TypeError(f"v0 must be a torch.Tensor or an EigenResult, got {type(v0).__name__}")
        if v0.numel() % n_local:
            raise ValueError(
                f"v0 must have shape ({n_local},) or ({b}, {n_local}) for block_size={b}, "
                f"got {tuple(v0.shape)}"
            )
        X0 = v0.reshape(-1, n_local).to(device=device, dtype=wd)
        if X0.shape[0] != b:
            raise ValueError(
                f"v0 must have shape ({n_local},) or ({b}, {n_local}) for block_size={b}, "
                f"got {tuple(v0.shape)}"
            )
        if not bool(torch.isfinite(X0).all()):
            raise ValueError("v0 has non-finite entries")
    if X0 is None:
        X0 = random_rows(b, n_local, gen, device=device, dtype=wd)
    Q0 = orthonormalize_rows(X0, backend)
    if Q0.shape[0] < b:
        raise ValueError(
            "the start vector is zero (or the start block is rank deficient); pass a nonzero v0 or leave v0=None"
        )
    V[:b] = Q0

    j = 0  # first row of the block being expanded
    restart_l = 0  # rows [0, restart_l) are kept Ritz vectors of the last restart
    products = 0
    anorm = 0.0
    exhausted = False
    theta = np.zeros(0)
    S = np.zeros((0, 0))
    est = np.zeros(0)
    order = np.zeros(0, dtype=np.int64)
    top = b
    it = 0
    st = _Krylov(
        op=op,
        backend=backend,
        gen=gen,
        V=V,
        T=T,
        Hf=Hf,
        lost=lost,
        n=n,
        full=full,
        noise=rounding_level(wd, op.dtype),
        eps=float(torch.finfo(wd).eps),
        # See NOTE [small operators on the host]
        Vn=V.numpy() if b == 1 and host_arithmetic(V, backend) else None,
    )
    noise = st.noise
    next_check = 0  # products at which the next Ritz check is due
    # checks are skipped only where a step costs about as little as a check: small operators
    # whose vectors live in host memory (NOTE [ritz check schedule])
    scheduled = V.device.type == "cpu" and V.numel() <= HOST_ARITHMETIC_MAX_NUMEL
    last_check: tuple[int, float] | None = None  # (products, worst est / threshold) of the last

    config: dict[str, Any] = {
        "n": n,
        "op_dtype": str(op.dtype),
        "work_dtype": str(wd),
        "k": k,
        "which": which,
        "tol": tol,
        "max_iter": max_iter if explicit_budget else None,
        "ncv": m,
        "block_size": block_size,
        "reorthogonalize": full,
        "residuals": residuals,
        "seed": seed,
        # the digest reads the whole warm start on the host: only when there is a file
        "v0": _digest(v0) if path is not None else None,
    }
    if resuming:
        assert path is not None
        loop = _restore(load_checkpoint(path, "lanczos", config, gen), V, T, Hf, lost, b, path)
        j, restart_l, it, anorm = loop["j"], loop["restart_l"], loop["it"], loop["anorm"]
        products = loop["products"]
        theta, S, est, order = loop["theta"], loop["S"], loop["est"], loop["order"]
        next_check, last_check = loop["next_check"], loop["last_check"]
    saved_at = products

    # the bar counts products with no total: max_iter is a cap that a converging run never
    # reaches, and a percentage of it would promise an ETA many times too long
    with progress_bar(None, f"lanczos (k={k})", progress) as bar:
        if products:
            bar.update(products)
        while True:
            it += 1
            top = j + b
            lo = 0 if (full or j == restart_l) else max(0, j - b)
            products += b
            if st.Vn is not None:
                Rh, anorm, exhausted = _host_step(st, j, lo, anorm, products)
            else:
                Rh, anorm, exhausted = _device_step(st, j, lo, b, anorm, products)
            bar.update(b)

            # Ritz pairs of the current basis and their residual estimates, when due: see
            # NOTE [ritz check schedule]. A restart and the last step need them (forced).
            last_step = products + b > iteration_budget
            if (top >= k or exhausted) and (
                products >= next_check or exhausted or last_step or top + b > m
            ):
                theta, S = np.linalg.eigh(T[:top, :top])
                anorm = max(anorm, float(np.abs(theta).max()))
                if exhausted:
                    est = np.zeros(top)
                elif b == 1:
                    est = np.abs(Rh[0, 0] * S[top - 1])
                else:
                    est = np.linalg.norm(Rh @ S[top - b : top, :], axis=0)
                order = _order(theta, which)
                want = order[:k]
                thresh = np.maximum(tol * np.abs(theta[want]), noise * anorm)
                ratio = float(np.max(est[want] / np.maximum(thresh, _TINY)))
                n_conv = int((est[want] <= thresh).sum())
                bar.set_postfix(converged=f"{n_conv}/{k}")
                # with exactly k Ritz values every one is "wanted": insist on one more to compare
                if exhausted or (top > k and n_conv == k):
                    break
                next_check = products + (
                    check_gap(ratio, products, last_check, b) if scheduled else b
                )
                last_check = (products, ratio)
            if last_step:
                break
            restarted = top + b > m
            if restarted:
                # thick restart: keep the n_keep most wanted Ritz vectors and the residual block
                # (n_conv: the Ritz check of this step, which a restart always makes)
                n_keep = _num_kept(k, m, b, n_conv)
                keep = order[:n_keep]
                if st.Vn is not None:  # See NOTE [small operators on the host]
                    st.Vn[:n_keep] = S[:, keep].T.astype(st.Vn.dtype) @ st.Vn[:top]
                    st.Vn[n_keep] = st.Vn[top]
                else:
                    Sk = torch.from_numpy(np.ascontiguousarray(S[:, keep].T)).to(
                        device=device, dtype=wd
                    )
                    V[:n_keep] = Sk @ V[:top]
                    V[n_keep : n_keep + b] = V[top : top + b].clone()  # the ranges may overlap
                coupling = Rh @ S[top - b : top, keep]
                _restart_record(Hf, lost, S[:, keep], top, b, noise * anorm)
                T[:] = 0.0
                T[:n_keep, :n_keep] = np.diag(theta[keep])
                T[n_keep : n_keep + b, :n_keep] = coupling
                T[:n_keep, n_keep : n_keep + b] = coupling.T
                j = n_keep
                restart_l = n_keep
            else:
                j = top
            if path is not None and (
                restarted if checkpoint_every is None else products - saved_at >= checkpoint_every
            ):
                loop = {
                    "j": j,
                    "restart_l": restart_l,
                    "products": products,
                    "it": it,
                    "anorm": anorm,
                    "next_check": next_check,
                    "last_check": None if last_check is None else list(last_check),
                }
                _save(path, config, gen, V, T, Hf, lost, j + b, loop, (theta, S, est, order))
                saved_at = products

    want = order[:k]
    Y = torch.from_numpy(np.ascontiguousarray(S[:, want].T)).to(device=device, dtype=wd) @ V[:top]
    lam = torch.from_numpy(theta[want].copy())
    if residuals == "exact":
        AY = apply_rows(op, Y)
        products += k
        Rm = AY - lam.to(device=device, dtype=wd).unsqueeze(1) * Y
        res = row_dots(backend, Rm, Rm).sqrt().to("cpu", torch.float64)
        if not bool(torch.isfinite(res).all()):
            raise non_finite_error("residual check", it)
    elif residuals == "recorded":
        res = torch.from_numpy(
            _recorded_residuals(
                Hf, T, lost, S[:, want], est[want], top, float(torch.finfo(op.dtype).eps) * anorm
            )
        )
    else:
        res = torch.from_numpy(est[want].copy())
    thresh_t = torch.clamp(tol * lam.abs(), min=noise * anorm)
    converged = res <= thresh_t
    if path is not None:  # finished: See NOTE [resumable lanczos]
        remove_checkpoint(path)
    if not bool(converged.all()):
        hint = "raise max_iter or ncv, or loosen tol"
        if residuals != "estimate" and bool((torch.from_numpy(est[want].copy()) <= thresh_t).all()):
            causes = op.inconsistency_causes()
            hint = (
                "the Ritz estimates met tol but the recomputed residuals "
                + ("(from the products made) " if residuals == "recorded" else "")
                + "did not, so the products are not consistent at that level"
                + (
                    f" ({'; '.join(causes)})"
                    if causes
                    else " (a product that is random or of low precision)"
                )
                + "; loosen tol"
            )
        warn_convergence(
            f"lanczos: {int(converged.sum())} of {k} eigenpairs converged to tol={tol:g} within "
            f"{products} products; {hint}"
        )
    return EigenResult(
        eigenvalues=lam,
        eigenvectors=Y.to(op.dtype),
        residuals=res,
        iterations=products,
        converged=converged,
        tol=float(tol),
        residual_floor=noise * anorm,  # See NOTE [convergence rule] in result
    )


# NOTE [resumable lanczos]
# Between two steps the iteration is: the basis rows V[:j + b] (the kept Ritz vectors and the
# block to expand next; the rows past them are written before they are read), the projected
# matrix T (zero outside [:j + b, :j + b]), the counters (j, restart_l, products, steps), the
# norm estimate, the Ritz data of the last check with the check schedule (NOTE [ritz check
# schedule]) and the generator (fresh directions after an invariant subspace). `_save`
# writes them (NOTE [checkpoint files] in `_checkpoint`); `_restore` puts them back into
# freshly allocated buffers, after which every step computes what it computed in the call
# that wrote them: same shapes, same data, same operations, hence the same bits on the same
# device and versions. The default saves at thick restarts, where the basis is smallest
# (n_keep + b rows). The start vector is not needed to resume (it is row 0 of the basis at
# the start), but a different one would have given another run: the config holds a digest of
# `v0`. A finished call deletes the file rather than marking it: the common way to reuse a
# path is a loop over training steps, where returning the stored result of an older
# operator would be silently wrong; a resumed file of an older operator is the caller's to
# avoid (the file cannot tell operators of the same size apart).


def _digest(v0: torch.Tensor | EigenResult | None) -> str | None:
    """Short fingerprint of a start vector / warm start, for the checkpoint's config."""
    if v0 is None:
        return None
    t = v0.eigenvectors if isinstance(v0, EigenResult) else v0
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    h = hashlib.sha256(raw)
    h.update(f"{type(v0).__name__}{tuple(t.shape)}{t.dtype}".encode())
    return f"sha256:{h.hexdigest()[:16]}"


def _save(
    path: Path,
    config: dict[str, Any],
    gen: torch.Generator,
    V: torch.Tensor,
    T: np.ndarray[Any, Any],
    Hf: np.ndarray[Any, Any],
    lost: np.ndarray[Any, Any],
    rows: int,
    loop: dict[str, Any],
    ritz: tuple[np.ndarray[Any, Any], ...],
) -> None:
    """The iteration between two steps: See NOTE [resumable lanczos]."""
    state = dict(loop)
    state["V"] = V[:rows].to("cpu", copy=True)  # a copy: a view would save the whole buffer
    state["T"] = torch.from_numpy(T[:rows, :rows].copy())
    state["Hf"] = torch.from_numpy(Hf[:rows, :rows].copy())
    state["lost"] = torch.from_numpy(lost.copy())
    for name, a in zip(("theta", "S", "est", "order"), ritz, strict=True):
        state[name] = torch.from_numpy(np.ascontiguousarray(a))
    save_checkpoint(path, "lanczos", config, state, gen)


def _restore(
    state: dict[str, Any],
    V: torch.Tensor,
    T: np.ndarray[Any, Any],
    Hf: np.ndarray[Any, Any],
    lost: np.ndarray[Any, Any],
    b: int,
    path: Path,
) -> dict[str, Any]:
    """Fill ``V`` and ``T`` from a checkpoint's state; the loop variables, as ``_save`` got them."""
    try:
        loop = {key: state[key] for key in ("j", "restart_l", "products", "it", "next_check")}
        if not all(isinstance(x, int) for x in loop.values()):
            raise TypeError("counters are not ints")
        loop["anorm"] = float(state["anorm"])
        last = state["last_check"]
        loop["last_check"] = None if last is None else (int(last[0]), float(last[1]))
        for name in ("theta", "S", "est", "order"):
            loop[name] = state[name].numpy()
        rows = loop["j"] + b
        Vs, Ts = state["V"], state["T"]
        if Vs.shape != (rows, V.shape[1]) or Vs.dtype != V.dtype or rows > V.shape[0]:
            raise ValueError(
                f"a basis of shape {tuple(Vs.shape)} ({Vs.dtype}), expected ({rows}, {V.shape[1]}) ({V.dtype})"
            )
        if Ts.shape != (rows, rows) or Ts.dtype != torch.float64:
            raise ValueError(f"a projection of shape {tuple(Ts.shape)}, expected ({rows}, {rows})")
        # a file of a version before NOTE [recorded residuals]: the symmetric part, nothing lost
        Hs, Ls = state.get("Hf", Ts), state.get("lost", torch.zeros(1, dtype=torch.float64))
        if Hs.shape != (rows, rows) or Ls.shape != (1,):
            raise ValueError(
                f"recorded products of shape {tuple(Hs.shape)}, expected ({rows}, {rows})"
            )
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ValueError(
            f"checkpoint {str(path)!r} is not a complete lanczos state for this call ({exc}); "
            "remove it to start afresh"
        ) from exc
    V[:rows] = Vs.to(V.device)
    T[:rows, :rows] = Ts.numpy()
    Hf[:rows, :rows] = Hs.numpy()
    lost[:] = Ls.numpy()
    return loop


_TINY = float(np.finfo(np.float64).tiny)


@dataclass
class _Krylov:
    """What a Lanczos step reads and writes: the basis ``V (ncv + b, n)`` (``Vn``: its numpy
    view when steps run on the host), the projected matrix ``T`` (host, float64)."""

    op: CurvatureOperator
    backend: LinAlgBackend
    gen: torch.Generator
    V: torch.Tensor
    Vn: np.ndarray[Any, Any] | None
    T: np.ndarray[Any, Any]
    Hf: np.ndarray[Any, Any]  # every product's projections: See NOTE [recorded residuals]
    lost: np.ndarray[Any, Any]  # (1,) bound of the parts of products that restarts dropped
    n: int  # global length
    full: bool  # full reorthogonalization
    noise: float
    eps: float
    R1: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros((1, 1)))  # host step's R


def _device_step(
    st: _Krylov, j: int, lo: int, b: int, anorm: float, products: int
) -> tuple[np.ndarray[Any, Any], float, bool]:
    """Expand the basis by the block ``V[j : j + b]``: one product, reorthogonalization
    against ``V[lo : j + b]``, the new block in ``V[j + b : j + 2b]`` and its couplings in
    ``T``. Returns the coupling ``R`` (host, ``(b, b)``), the updated norm estimate and
    whether the Krylov space is exhausted."""
    V, T, backend = st.V, st.T, st.backend
    top = j + b
    W = apply_rows(st.op, V[j:top])
    B = V[lo:top]
    H = backend.inner_rows(B, W)  # (top - lo, b)
    W = W - H.T @ B
    if st.full:
        H2 = backend.inner_rows(B, W)
        W = W - H2.T @ B
        H = H + H2
    Q, R = _block_qr(W, backend)
    # the one host sync of this step: the projections H (NOTE [recorded residuals]; its last
    # block is T's diagonal block) and the coupling R
    rows = top - lo
    host = torch.cat([H.reshape(-1), R.reshape(-1)]).to("cpu", torch.float64).numpy()
    if not np.isfinite(host).all():
        raise non_finite_error(f"after {products} products", products // b)
    Hh = host[: rows * b].reshape(rows, b)
    Hd = Hh[-b:]
    Rh = host[rows * b :].reshape(b, b)
    st.Hf[lo:top, j:top] = Hh
    T[j:top, j:top] = 0.5 * (Hd + Hd.T)
    anorm = max(anorm, float(np.abs(T[j:top, j:top]).max()), float(np.abs(Rh).max()))
    diag = np.abs(np.diag(Rh))
    exhausted = False
    if b == 1 and diag.min() < math.sqrt(st.eps) * anorm and diag.min() > st.noise * anorm:
        # small residual: one more Gram-Schmidt pass keeps Q orthogonal to the basis
        Q = Q - backend.inner_rows(Q, V[:top]) @ V[:top]
        Q = Q / backend.norm(Q)
    if diag.min() <= st.noise * max(anorm, torch.finfo(torch.float64).tiny):
        # invariant subspace (or the whole space) reached: continue with a fresh
        # direction orthogonal to the basis; its coupling to the basis is W's
        Q, Rh, exhausted = _fresh_block(W, V[:top], b, st.n, st.gen, backend)
    if not exhausted:
        V[top : top + b] = Q
        T[top : top + b, j:top] = Rh
        T[j:top, top : top + b] = Rh.T
        st.Hf[top : top + b, j:top] = Rh
    return Rh, anorm, exhausted


def _host_step(
    st: _Krylov, j: int, lo: int, anorm: float, products: int
) -> tuple[np.ndarray[Any, Any], float, bool]:
    """``_device_step`` for ``b = 1`` in numpy on the host view ``Vn`` of the basis
    (the same arithmetic and tests). See NOTE [small operators on the host]."""
    Vn, T = st.Vn, st.T
    assert Vn is not None
    top = j + 1
    w = host_matvec(st.op, Vn[j])
    B = Vn[lo:top]
    h = B @ w
    w = w - h @ B  # a new array: the product's output may be the operator's own buffer
    if st.full:
        h2 = B @ w
        w -= h2 @ B
        h += h2
    alpha = float(h[-1])
    beta = math.sqrt(float(w @ w))
    if not (math.isfinite(alpha) and math.isfinite(beta)):
        raise non_finite_error(f"after {products} products", products)
    st.Hf[lo:top, j] = h  # See NOTE [recorded residuals]
    T[j, j] = alpha
    anorm = max(anorm, abs(alpha), beta)
    exhausted = False
    if beta <= st.noise * max(anorm, _TINY):
        # invariant subspace (or the whole space) reached, as in _device_step
        Q, Rh, exhausted = _fresh_block(
            torch.from_numpy(w).unsqueeze(0), st.V[:top], 1, st.n, st.gen, st.backend
        )
        if exhausted:
            return Rh, anorm, True
        beta = float(Rh[0, 0])
        Vn[top] = Q[0].numpy()
    else:
        q = np.divide(w, beta, out=Vn[top])  # the new basis vector, written in place
        if beta < math.sqrt(st.eps) * anorm:
            # small residual: one more Gram-Schmidt pass keeps q orthogonal to the basis
            q -= (Vn[:top] @ q) @ Vn[:top]
            q /= math.sqrt(float(q @ q))
    T[top, j] = T[j, top] = st.Hf[top, j] = beta
    st.R1[0, 0] = beta
    return st.R1, anorm, False


# NOTE [ritz check schedule]
# A Ritz check (eigh of T, (ncv, ncv) on the host: 70-230 us for ncv = 20-40 on the 2-core CI
# machine, whatever the operator) on every step cost more than the step itself for small
# operators: 47 checks were over half of lanczos(which="SA") on an 80 x 80 matrix. Skipping a
# check never changes the iterates (a restart and the last step always check, since they use
# the Ritz vectors), but it can make the solver stop later than the first step at which the
# pairs met tol, and for an operator backed by a model a product costs far more than a check.
# So checks are skipped only for small operators whose vectors live in host memory
# (a basis on the CPU of at most HOST_ARITHMETIC_MAX_NUMEL numbers, whatever the backend); every other run checks on
# every step (a check is < 1% of a model's product). The rule is decided by sizes, never by
# timings, so that a run's products and results do not depend on the machine's load.
# When skipping: the residual estimates of the wanted pairs fall about geometrically, so from
# the worst ratio est / threshold of the last two checks (r_prev at p_prev products, r now at p)
# the remaining products are predicted as s = log r / g with g = log(r_prev / r) / (p - p_prev);
# the next check comes after half of that, at most a quarter of the products so far, at least
# one step; a ratio that did not fall, or the first check, checks again at the next step.
# Lanczos converges superlinearly within a cycle, so the prediction alone overshoots:
# benchmarks/check_schedule.py (270 runs: 5 spectra at n = 40 and 300, LM/LA/SA, k = 3/6/10,
# tol 1e-4/1e-6/1e-8) measured half the prediction stopping later than checking every step in
# 65 runs, by 430 products in all; with the quarter cap, 3 runs and 5 products (an eighth: none,
# but 20% slower on the 80 x 80 SA run). Eigensolves there: 15565 every step, 13877 capped (the
# restarts, which always solve, are most of them); on the 80 x 80 SA run, 21 instead of 47. On
# the 200 x 200 run pinned in tests/perf/test_counts.py, the prediction alone (session 7, on
# every operator) stopped at 19 products instead of 14. Power iteration does not use the
# schedule: its deflated runs stall and then drop.


# NOTE [recorded residuals]
# The residual of a Ritz pair without a product (issue 25: the k products of recomputing them
# put the default above ARPACK's count). With full reorthogonalization each product is written
# whole in the basis: A v_c = sum_i Hf[i, c] v_i (+ the residual block), where column c of Hf
# holds the product's projections onto every basis vector (two Gram-Schmidt passes) and its
# coupling to the next block; only rounding is left out. T, the symmetric matrix the Ritz pairs
# come from, keeps only the symmetric tridiagonal part of that. So for y = V s,
# A y - θ y = V (Hf - T) s + V_next (R s_last): its norm is sqrt(||(Hf - T) s||² + est²), est
# the Lanczos estimate ||R s_last||, from (ncv + b)² numbers on the host. For products that are
# one fixed symmetric matrix, Hf = T up to rounding and this is est; for products that are not
# (random, asymmetric, low precision), Hf records what they did and the residual shows it, as a
# recomputation would. A thick restart keeps y_i = V s_i: their products become P = Sₖᵀ Hf Sₖ
# within the kept vectors, the coupling to the residual block, and a part D = (I - Sₖ Sₖᵀ) Hf Sₖ
# outside the new basis, which is dropped. The dropped parts of all restarts form a matrix L
# (n x kept rows) with L' = L Sₖ + D at each restart, so ||L||₂ <= sum of ||D||₂ (Sₖ has
# orthonormal columns), and a residual adds that bound (`lost`), an upper bound.
# Rounding: for a consistent operator each ||D||₂ is rounding-sized, but dozens of restarts add
# up, and near the floor of the convergence rule (about 100 eps ||A||, NOTE [convergence rule])
# that matters: a first version, bounding the dropped parts row by row with |Sₖ|ᵀ, grew
# geometrically (1e-2 for true residuals of 1e-5 after 80 restarts) and left pairs at the floor
# (zero eigenvalues) unconverged that a recomputation accepts. So each restart adds only the
# part of ||D||₂ above the floor: dropped inconsistencies below it are rounding for this rule.
# An invariant subspace's remainder (below the floor by its test) is dropped likewise. The
# Lanczos estimate keeps falling below rounding (to 0 in float32 runs), where a recomputation
# adds a product's own rounding: the residual includes eps(operator dtype) · ||A|| in
# quadrature, so it never claims less than a product resolves (the CLI's float32 problem:
# 1.3e-8 to 4e-8 recomputed, 1.9e-8 to 2.9e-8 recorded, 0 to 2e-8 without that term).
# Cost: one (ncv + b)² float64 matrix on the host, the whole projection column in the step's
# one host sync (top · b numbers instead of b²), a (top x top) product per restart: no
# operator product, no extra sync. Measured on the test spectra in float64 (n = 300, k = 10,
# five spectra, LM/LA/SA, b = 1 and 4, tol 1e-4 and 1e-6): within 0.23 · (recomputed residual
# + floor) of a recomputation, the same flags, and exactly the products of
# residuals="estimate", at most ARPACK's (tests/algorithms/test_products_vs_arpack.py).
def _restart_record(
    Hf: np.ndarray[Any, Any],
    lost: np.ndarray[Any, Any],
    Sk: np.ndarray[Any, Any],
    top: int,
    b: int,
    floor: float,
) -> None:
    """``Hf`` and ``lost`` for the kept Ritz vectors ``V[:top] Sk`` and the residual block, in
    place (the caller then moves the basis). See NOTE [recorded residuals]."""
    n_keep = Sk.shape[1]
    M = Hf[:top, :top] @ Sk  # products of the kept vectors within the old basis
    P = Sk.T @ M
    dropped = float(np.linalg.norm(M - Sk @ P))  # Frobenius: bounds the 2-norm, no SVD
    coupling = Hf[top : top + b, :top] @ Sk
    Hf[:] = 0.0
    Hf[:n_keep, :n_keep] = P
    Hf[n_keep : n_keep + b, :n_keep] = coupling
    lost[0] += max(0.0, dropped - floor)


def _recorded_residuals(
    Hf: np.ndarray[Any, Any],
    T: np.ndarray[Any, Any],
    lost: np.ndarray[Any, Any],
    Sw: np.ndarray[Any, Any],
    est: np.ndarray[Any, Any],
    top: int,
    product_rounding: float,
) -> np.ndarray[Any, Any]:
    """``||A y - θ y||`` of the Ritz vectors ``V[:top] Sw`` from the recorded products (``est``:
    their Lanczos estimates; ``product_rounding``: eps of the operator's dtype times ``||A||``).
    See NOTE [recorded residuals]."""
    inner = np.linalg.norm((Hf[:top, :top] - T[:top, :top]) @ Sw, axis=0)
    return np.sqrt(est**2 + inner**2 + product_rounding**2) + lost[0]


def _num_kept(k: int, m: int, b: int, n_conv: int) -> int:
    """Ritz vectors kept at a restart.

    Keeping more than ``k`` makes the next cycle converge faster (the kept
    extras damp the unwanted part) but leaves fewer new directions per cycle.
    ``k`` plus a fifth of the free room, plus half of it scaled by the
    converged count as ARPACK grows its kept set: measured against ARPACK
    on power-law, separated, clustered and exponential spectra
    (``benchmarks/bench_algorithms.py``), this is never worse and usually
    10-20% fewer products.
    """
    free = m - b - k
    extra = min(free, max(1, round(0.2 * free) + min(n_conv, free) // 2))
    return max(1, k + extra)


def _fresh_block(
    W: torch.Tensor,
    basis: torch.Tensor,
    b: int,
    n: int,
    gen: torch.Generator,
    backend: LinAlgBackend,
) -> tuple[torch.Tensor, np.ndarray, bool]:
    """Orthonormal rows ``Q (b, n)`` spanning ``W``'s numerically nonzero part,
    completed by random directions orthogonal to ``basis``; ``W = Rᵀ Q``.

    Returns ``exhausted=True`` when the basis already spans the whole space
    (``n`` is the global length; vectors may be local shards).
    """
    J = basis.shape[0]
    if J + b > n:
        return W, np.zeros((b, b)), True
    Z = random_rows(b, W.shape[1], gen, device=W.device, dtype=W.dtype)
    for _ in range(2):
        Z = Z - backend.inner_rows(Z, basis) @ basis
    Qw = orthonormalize_rows(W, backend, rtol=math.sqrt(float(torch.finfo(W.dtype).eps)))
    Qw = Qw[:b]
    for _ in range(2):
        Z = Z - backend.inner_rows(Z, Qw) @ Qw
    Qz = orthonormalize_rows(Z, backend)
    Q = torch.cat([Qw, Qz])[:b]
    if Q.shape[0] < b:
        return W, np.zeros((b, b)), True
    R = backend.inner_rows(Q, W).to("cpu", torch.float64).numpy()  # W ≈ Rᵀ Q
    return Q.contiguous(), R, False


def lanczos_tridiagonal(
    op: CurvatureOperator,
    v0: torch.Tensor,
    max_iter: int,
    *,
    reorthogonalize: bool = True,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    keep_basis: bool = True,
) -> LanczosTridiag:
    """One unrestarted Lanczos run of ``max_iter`` steps from ``v0`` (shared with SLQ).

    Stops early when the Krylov space becomes invariant (``last_beta ≈ 0``),
    so ``iterations`` may be smaller than ``max_iter``. ``v0`` is normalized.
    """
    op = check_operator(op)
    if not isinstance(v0, torch.Tensor):
        raise TypeError(f"v0 must be a torch.Tensor, got {type(v0).__name__}")
    if v0.shape != (op.size,):  # local shard
        raise ValueError(f"v0 must have shape ({op.size},), got {tuple(v0.shape)}")
    runs = tridiagonal_runs(
        op,
        v0.unsqueeze(0),
        max_iter,
        reorthogonalize=reorthogonalize,
        backend=operator_backend(op, backend),
        precision=precision,
        keep_basis=keep_basis,
    )
    return runs[0]


def tridiagonal_runs(
    op: CurvatureOperator,
    V0: torch.Tensor,
    steps: int,
    *,
    reorthogonalize: bool,
    backend: LinAlgBackend,
    precision: torch.dtype | None,
    keep_basis: bool,
    bar: object | None = None,
) -> list[LanczosTridiag]:
    """``r`` independent Lanczos runs in lockstep: one ``op @ V`` block per step.

    Each run's basis is a slice of one ``(r, steps, n)`` buffer and is
    reorthogonalized by batched matrix products (CGS2). A run that hits an
    invariant subspace stops (its vector is zeroed, costing nothing but
    arithmetic) while the others go on. One host sync per step.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"max_iter must be a positive int, got {steps!r}")
    n = op.size
    r = V0.shape[0]
    steps = min(steps, global_size(op))
    wd = work_dtype(op, precision)
    eps = max(float(torch.finfo(wd).eps), float(torch.finfo(op.dtype).eps))
    device = op.device
    X = V0.to(device=device, dtype=wd)
    norms = row_dots(backend, X, X).sqrt()
    host_norms = norms.to("cpu", torch.float64).numpy()
    if not np.isfinite(host_norms).all() or (host_norms == 0).any():
        raise ValueError("the start vector is zero or non-finite; pass a nonzero finite v0")
    X = X / norms.unsqueeze(1)
    store = reorthogonalize or keep_basis
    Vb = torch.empty(r, steps if store else 2, n, dtype=wd, device=device)
    Vb[:, 0] = X
    alphas = np.zeros((r, steps))
    betas = np.zeros((r, steps))
    length = np.full(r, steps)
    active = np.ones(r, dtype=bool)
    anorm = np.zeros(r)
    prev_beta = torch.zeros(r, dtype=wd, device=device)
    for j in range(steps):
        cur = Vb[:, j] if store else Vb[:, j % 2]
        W = apply_rows(op, cur)
        if reorthogonalize:
            basis = Vb[:, : j + 1]
            H = backend.all_reduce_sum(torch.bmm(basis, W.unsqueeze(2)).squeeze(2))  # (r, j+1)
            W = W - torch.bmm(H.unsqueeze(1), basis).squeeze(1)
            H2 = backend.all_reduce_sum(torch.bmm(basis, W.unsqueeze(2)).squeeze(2))
            W = W - torch.bmm(H2.unsqueeze(1), basis).squeeze(1)
            alpha = (H + H2)[:, j]
        else:
            alpha = row_dots(backend, cur, W)
            W = W - alpha.unsqueeze(1) * cur
            if j > 0:
                prev = Vb[:, j - 1] if store else Vb[:, (j - 1) % 2]
                W = W - prev_beta.unsqueeze(1) * prev
        beta = row_dots(backend, W, W).sqrt()
        host = torch.cat([alpha, beta]).to("cpu", torch.float64).numpy()
        if not np.isfinite(host[:r][active]).all() or not np.isfinite(host[r:][active]).all():
            raise non_finite_error("Lanczos step", j + 1)
        a_h, b_h = host[:r], host[r:]
        alphas[active, j] = a_h[active]
        betas[active, j] = b_h[active]
        anorm = np.maximum(anorm, np.abs(a_h) + np.abs(b_h))
        done = active & (b_h <= 100 * eps * np.maximum(anorm, 1e-300))
        length[done] = j + 1
        active &= ~done
        if bar is not None:
            bar.update(1)  # type: ignore[attr-defined]
        if not active.any() or j + 1 == steps:
            break
        scale = torch.from_numpy(np.where(active, 1.0 / np.maximum(b_h, 1e-300), 0.0)).to(
            device=device, dtype=wd
        )
        nxt = W * scale.unsqueeze(1)
        if store:
            Vb[:, j + 1] = nxt
        else:
            Vb[:, (j + 1) % 2] = nxt
        prev_beta = beta
    out = []
    for i in range(r):
        m = int(length[i])
        out.append(
            LanczosTridiag(
                alphas=torch.from_numpy(alphas[i, :m].copy()),
                betas=torch.from_numpy(betas[i, : m - 1].copy()),
                basis=Vb[i, :m].to(op.dtype) if (keep_basis and store) else None,
                last_beta=float(betas[i, m - 1]),
                iterations=m,
            )
        )
    return out
