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
in the working dtype (or, with ``basis_device="cpu"``, in host memory streamed to the
device in panels: NOTE [basis off the device] in ``basis``); each step applies the operator once (``b`` products for
a block of ``b``), reorthogonalizes against the whole basis by classical
Gram-Schmidt twice, both as matrix products, and synchronizes with the host
once to read the new coefficients (the ``T`` matrix is small and lives on the
host in float64). Ritz convergence is checked within a restart cycle, on a
schedule that predicts from the residual estimates when the wanted pairs will
meet ``tol`` (NOTE [ritz check schedule] in ``krylov``), so the solver stops at the step
where they do instead of at the end of a restart cycle, without a Ritz
eigensolve on every step.

Cost: ``max_iter`` products at most; the residuals come from the products made
(``residuals="recorded"``, NOTE [recorded residuals] in ``krylov``), or cost ``k`` more products
(``residuals="exact"``); ``O(ncv · n)`` flops per product for
reorthogonalization; memory ``(ncv + b) · n`` working-dtype numbers plus a
restart buffer of ``l · n``.

The iteration itself (the plan, the run state, its steps, restarts and checkpoints) lives in
:mod:`hessian_eigenthings.algorithms.krylov`; ``lanczos`` validates, starts and drives it.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hessian_eigenthings._checks import InternalError, check_count
from hessian_eigenthings.algorithms._checkpoint import (
    checkpoint_path,
    load_checkpoint,
    rank_entries,
    remove_checkpoint,
    save_checkpoint,
)
from hessian_eigenthings.algorithms._common import (
    apply_rows,
    check_operator,
    global_size,
    make_generator,
    non_finite_error,
    operator_backend,
    orthonormalize_rows,
    progress_bar,
    random_rows,
    row_dots,
    warm_start_rows,
    work_dtype,
)
from hessian_eigenthings.algorithms.basis import RunBases, as_basis_device, new_run_bases
from hessian_eigenthings.algorithms.krylov import KrylovState, LanczosPlan, Residuals, Which
from hessian_eigenthings.algorithms.result import EigenResult, LanczosTridiag
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator

__all__ = ["LanczosTridiag", "Which", "check_symmetry", "lanczos", "lanczos_tridiagonal"]


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
    residuals: Residuals = "recorded",
    check_symmetric: bool = False,
    progress: bool | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    basis_device: str | torch.device | None = None,
) -> EigenResult:
    """Top-``k`` eigenpairs of a symmetric operator by thick-restart Lanczos.

    Args:
        k: number of eigenpairs.
        max_iter: budget of operator products (a block of ``b`` counts ``b``); default
            ``max(1000, 30 · ncv)``. One you pass bounds every product, the ``k`` of
            ``residuals="exact"`` included (NOTE [explicit lanczos budget] in ``krylov``).
        tol: a pair is converged when ``||A v - θ v|| <= max(tol · |θ|, floor)``, the floor
            being what rounding alone makes (``result.residual_floor``; NOTE [convergence
            rule] in ``result``).
        reorthogonalize: ``None``/``True``: full (classical Gram-Schmidt twice). ``False``:
            against the previous block only: cheaper, but spurious copies can appear.
        which: ``"LM"`` / ``"LA"`` / ``"SA"``: largest magnitude / largest / smallest
            algebraic; results come most wanted first.
        seed: seed of the start vector (a local generator).
        ncv: basis size before a thick restart (ARPACK's ``ncv``); default
            ``min(n, max(2k + 1, 20, k + 2b, 10b))``.
        block_size: ``b > 1``: block Lanczos, ``b`` products in one ``op @ V`` pass per step
            (more products, fewer passes; repeated eigenvalues up to multiplicity ``b``; when
            it pays: the reference page). ``b = 1`` when ``ncv + b > n``.
        v0: start vector ``(n,)`` or block ``(b, n)``; or a warm start: a previous
            ``EigenResult`` or a basis ``(p, n)`` / ``(n, p)`` (NOTE [warm starts] in ``_common``).
        precision: working dtype of the basis (NOTE [mixed precision] in ``_common``).
        residuals: ``"recorded"``: from the products made, at no product (NOTE [recorded
            residuals]; ``"exact"`` when ``reorthogonalize=False``); ``"exact"``: recomputed
            with ``k`` products; ``"estimate"``: the Lanczos estimates ``||R s_last||``.
        check_symmetric: spend 2 products checking that ``op`` is symmetric.
        progress: ``True`` a tqdm bar, ``False`` nothing; ``None`` a bar on a terminal or
            in Jupyter, elsewhere a log line on stderr every 30 s.
        checkpoint: a file to save the iteration to and to resume from, bit for bit
            (NOTE [resumable lanczos] in ``krylov``); one of other arguments is refused; a finished call
            deletes it. One file per rank (another rank's, or one of another rank count, is
            refused).
        checkpoint_every: save every this many products; default: at each thick restart.
        basis_device: where the Krylov basis lives; default (``None``) the operator's device.
            ``"cpu"``: in host memory (pinned when the operator is on CUDA), moved to the
            operator's device in panels of at most ``basis.CHUNK_BYTES`` (1 GiB) for each
            product with it, for models whose basis does not fit beside them (NOTE [basis off
            the device] in ``basis``). The same products and, to rounding, the same result;
            the eigenvectors are then returned in host memory. Each step moves about
            ``3 · rows + b`` vectors to the device and ``b`` back.

    Returns an :class:`EigenResult`, most wanted first; warns :class:`ConvergenceWarning` when
    the budget ends first. An exhausted Krylov space gives the exact answer.
    """
    op = check_operator(op)
    backend = operator_backend(op, backend)
    plan = LanczosPlan.for_call(
        op, k=k, max_iter=max_iter, tol=tol, reorthogonalize=reorthogonalize, which=which,
        ncv=ncv, block_size=block_size, residuals=residuals, precision=precision,
        basis_device=basis_device,
    )  # fmt: skip
    saves = _Saves.for_call(checkpoint, checkpoint_every)
    resuming = saves.path is not None and saves.path.exists()
    op.expect_products(min(plan.max_iter, 3 * plan.ncv))  # a typical run: a few restarts
    if check_symmetric and not resuming:  # the call that wrote the checkpoint checked
        check_symmetry(op, seed=seed, backend=backend)
    gen = make_generator(seed, backend)
    start = _start_block(v0, plan, op.device, gen, backend)
    # the digest reads the whole warm start on the host: only when there is a file
    saves.config = plan.config(op, seed, _digest(v0) if saves.path is not None else None)
    # a sharded run's file holds its rank's pieces: NOTE [checkpoints of sharded runs]
    saves.config.update(rank_entries(backend))
    if resuming:
        run = saves.resume(plan, op, backend, gen)
    else:
        run = KrylovState(plan, op, backend, gen, start)
    try:
        result = _iterate(run, saves, gen, progress)
    finally:
        run.basis.release()
    saves.finish()
    run.warn_unconverged(result)
    return result


def _iterate(
    run: KrylovState, saves: _Saves, gen: torch.Generator, progress: bool | None
) -> EigenResult:
    """Step ``run`` until it is done or its budget ends; its result."""
    plan = run.plan
    # the bar counts products with no total: max_iter is a cap that a converging run never
    # reaches, and a percentage of it would promise an ETA many times too long
    with progress_bar(None, f"lanczos (k={plan.k})", progress) as bar:
        if run.products:
            bar.update(run.products)
        while True:
            run.step()
            bar.update(plan.block)
            if run.check_due():
                done = run.check()
                bar.set_postfix(converged=f"{run.n_conv}/{plan.k}")
                if done:
                    break
            if run.last_step:
                break
            saves.after_advance(run, restarted=run.advance(), gen=gen)
    return run.result()


@dataclass
class _Saves:
    """Where and when a ``lanczos`` call saves its iteration: See NOTE [resumable lanczos]."""

    path: Path | None
    every: int | None  # products between saves; None: at each thick restart
    config: dict[str, Any] = field(default_factory=dict)  # the call's arguments
    saved_at: int = 0  # products at the last save

    @classmethod
    def for_call(cls, checkpoint: str | os.PathLike[str] | None, every: int | None) -> _Saves:
        every = check_count("checkpoint_every", every, allow_none=True)
        path = checkpoint_path(checkpoint)
        if every is not None and path is None:
            raise ValueError(
                "checkpoint_every is given without checkpoint= (a file to save the iteration to)"
            )
        return cls(path, every)

    def resume(
        self,
        plan: LanczosPlan,
        op: CurvatureOperator,
        backend: LinAlgBackend,
        gen: torch.Generator,
    ) -> KrylovState:
        """The saved iteration (``gen`` set to the saved generator state)."""
        if self.path is None:
            raise InternalError("self.path is not None")
        state = load_checkpoint(self.path, "lanczos", self.config, gen)
        run = KrylovState.from_checkpoint(state, plan, op, backend, gen, self.path)
        self.saved_at = run.products
        return run

    def after_advance(self, run: KrylovState, *, restarted: bool, gen: torch.Generator) -> None:
        if self.path is None:
            return
        if restarted if self.every is None else run.products - self.saved_at >= self.every:
            save_checkpoint(self.path, "lanczos", self.config, run.to_checkpoint(), gen)
            self.saved_at = run.products

    def finish(self) -> None:
        """A finished call deletes its file: See NOTE [resumable lanczos]."""
        if self.path is not None:
            remove_checkpoint(self.path)


def _start_block(
    v0: torch.Tensor | EigenResult | None,
    plan: LanczosPlan,
    device: torch.device,
    gen: torch.Generator,
    backend: LinAlgBackend,
) -> torch.Tensor:
    """The orthonormal start block ``(b, n)``: from ``v0`` (a start vector or block, or a warm
    start: See NOTE [warm starts]) or random; raises for a ``v0`` that cannot start."""
    b, n_local, wd = plan.block, plan.n_local, plan.work_dtype
    X0 = None
    if v0 is not None and _is_warm_basis(v0, n_local, b):
        # a previous result or a basis of p != b vectors: See NOTE [warm starts]
        Y = warm_start_rows(v0, n_local, "v0")
        if Y is not None:
            # a basis off the device: a warm start's k vectors are summed where they are
            where = device if plan.basis_device is None else Y.device
            Y = Y.to(device=where, dtype=wd)
            # row i of the start block sums the vectors i, i + b, i + 2b, ... (all of them for b = 1)
            G = torch.zeros(b, Y.shape[0], dtype=wd, device=where)
            G[torch.arange(Y.shape[0]) % b, torch.arange(Y.shape[0])] = 1.0
            X0 = (G @ Y).to(device)
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
    return Q0


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


def lanczos_tridiagonal(
    op: CurvatureOperator,
    v0: torch.Tensor,
    max_iter: int,
    *,
    reorthogonalize: bool = True,
    backend: LinAlgBackend | None = None,
    precision: torch.dtype | None = None,
    keep_basis: bool = True,
    basis_device: str | torch.device | None = None,
) -> LanczosTridiag:
    """One unrestarted Lanczos run of ``max_iter`` steps from ``v0`` (shared with SLQ).

    Stops early when the Krylov space becomes invariant (``last_beta ≈ 0``),
    so ``iterations`` may be smaller than ``max_iter``. ``v0`` is normalized.
    ``basis_device``: where the basis lives, as in :func:`lanczos` (``"cpu"``: host memory,
    streamed to the operator's device; ``basis`` is then returned in host memory).
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
        basis_device=basis_device,
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
    basis_device: str | torch.device | None = None,
) -> list[LanczosTridiag]:
    """``r`` independent Lanczos runs in lockstep: one ``op @ V`` block per step.

    Each run's basis is a slice of one ``(r, steps, n)`` buffer and is
    reorthogonalized by batched matrix products (CGS2); with ``basis_device``, the buffer
    lives there and is streamed (NOTE [basis off the device] in ``basis``). A run that hits an
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
    where = as_basis_device(basis_device)
    Vb = new_run_bases(r, steps if store else 2, n, wd, device, where if store else None)
    try:
        return _runs(op, Vb, X, steps, reorthogonalize, backend, eps, keep_basis and store, bar)
    finally:
        Vb.release()


def _runs(
    op: CurvatureOperator,
    Vb: RunBases,
    X: torch.Tensor,
    steps: int,
    reorthogonalize: bool,
    backend: LinAlgBackend,
    eps: float,
    keep_basis: bool,
    bar: object | None,
) -> list[LanczosTridiag]:
    """The steps of :func:`tridiagonal_runs` from the unit rows ``X``, bases in ``Vb``."""
    r, device, wd = X.shape[0], X.device, X.dtype
    Vb.set(0, X)
    alphas = np.zeros((r, steps))
    betas = np.zeros((r, steps))
    length = np.full(r, steps)
    active = np.ones(r, dtype=bool)
    anorm = np.zeros(r)
    prev_beta = torch.zeros(r, dtype=wd, device=device)
    for j in range(steps):
        cur = Vb.vector(j)
        W = apply_rows(op, cur)
        if reorthogonalize:
            W, H = Vb.reorthogonalize(j + 1, W, backend)  # H: (r, j + 1)
            alpha = H[:, j]
        else:
            alpha = row_dots(backend, cur, W)
            W = W - alpha.unsqueeze(1) * cur
            if j > 0:
                W = W - prev_beta.unsqueeze(1) * Vb.vector(j - 1)
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
        Vb.set(j + 1, W * scale.unsqueeze(1))
        prev_beta = beta
    out = []
    for i in range(r):
        m = int(length[i])
        out.append(
            LanczosTridiag(
                alphas=torch.from_numpy(alphas[i, :m].copy()),
                betas=torch.from_numpy(betas[i, : m - 1].copy()),
                basis=Vb.basis(i, m).to(op.dtype) if keep_basis else None,
                last_beta=float(betas[i, m - 1]),
                iterations=m,
            )
        )
    return out
