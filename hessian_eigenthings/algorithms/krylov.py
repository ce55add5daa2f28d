"""The thick-restart Lanczos iteration of ``lanczos`` as data: a plan and a run state.

A :class:`LanczosPlan` is what one call will do, fixed before its first product: the
budget, the basis size ``ncv``, the block size, the residual policy (NOTE [explicit
lanczos budget]). A :class:`KrylovState` is the iteration between two steps: the basis,
the projected matrix ``T``, the recorded projections of every product (NOTE [recorded
residuals]), the counters and the Ritz data of the last check. It moves by ``step`` (one
product of a block), ``check`` (the Ritz pairs, on the schedule of NOTE [ritz check
schedule]), ``advance`` (the next block, or a thick restart), and round-trips through a
checkpoint file (``to_checkpoint`` / ``from_checkpoint``, NOTE [resumable lanczos]). The
math and the cost are in the docstring of :mod:`hessian_eigenthings.algorithms.lanczos`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from hessian_eigenthings._checks import InternalError, check_count
from hessian_eigenthings.algorithms._common import (
    HOST_ARITHMETIC_MAX_NUMEL,
    apply_rows,
    check_gap,
    check_k,
    global_size,
    host_matvec,
    householder_ok,
    non_finite_error,
    orthonormalize_rows,
    random_rows,
    rounding_level,
    row_dots,
    work_dtype,
)
from hessian_eigenthings.algorithms.basis import (
    CHUNK_BYTES,
    KrylovBasis,
    as_basis_device,
    new_basis,
    panel_width,
)
from hessian_eigenthings.algorithms.result import EigenResult, warn_convergence
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator

Which = Literal["LM", "LA", "SA"]
Residuals = Literal["recorded", "exact", "estimate"]

__all__ = ["KrylovState", "LanczosPlan", "Residuals", "Which", "ritz_order"]


def ritz_order(theta: np.ndarray, which: str) -> np.ndarray:
    """Indices of ``theta`` from most to least wanted."""
    if which == "LM":
        return np.argsort(-np.abs(theta), kind="stable")
    if which == "LA":
        return np.argsort(-theta, kind="stable")
    return np.argsort(theta, kind="stable")


@dataclass(frozen=True)
class LanczosPlan:
    """What one ``lanczos`` call does, decided from its arguments before any product."""

    n: int  # global length: caps k, ncv and the Krylov depth
    n_local: int  # this rank's shard: the length of the vectors
    k: int
    which: Which
    tol: float
    block_size: int  # as asked
    block: int  # as run: 1 when the whole space fits in the basis
    ncv: int  # basis rows before a thick restart
    max_iter: int  # products the call may make
    explicit_budget: bool  # max_iter was passed: See NOTE [explicit lanczos budget]
    iteration_budget: int  # products of the iteration (max_iter less an exact residual check)
    full: bool  # full reorthogonalization
    residuals: Residuals  # the policy after the budget's adjustments
    work_dtype: torch.dtype
    # where the basis lives (None: the operator's device); See NOTE [basis off the device]
    basis_device: torch.device | None = None

    @classmethod
    def for_call(
        cls,
        op: CurvatureOperator,
        *,
        k: int,
        max_iter: int | None,
        tol: float,
        reorthogonalize: bool | None,
        which: Which,
        ncv: int | None,
        block_size: int,
        residuals: Residuals,
        precision: torch.dtype | None,
        basis_device: str | torch.device | None = None,
    ) -> LanczosPlan:
        """Validate ``lanczos``'s arguments and fix the budget; raises ``ValueError`` naming
        the argument to change."""
        n = global_size(op)  # caps (k, ncv, exhaustion) use the whole length
        check_k(k, n)
        if which not in ("LM", "LA", "SA"):
            raise ValueError(f"which must be 'LM', 'LA' or 'SA', got {which!r}")
        if residuals not in ("recorded", "exact", "estimate"):
            raise ValueError(
                f"residuals must be 'recorded', 'exact' or 'estimate', got {residuals!r}"
            )
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
        wd = work_dtype(op, precision)
        itemsize = torch.empty((), dtype=wd).element_size()
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
                f"max_iter={max_iter} products cannot give k={k} eigenpairs; use at least "
                f"{min(n, k + b)} (max_iter counts operator products, not restarts)"
            )
        return cls(
            n=n,
            n_local=op.size,  # vectors are this rank's shard
            k=k,
            which=which,
            tol=tol,
            block_size=block_size,
            block=b,
            ncv=ncv,
            max_iter=max_iter,
            explicit_budget=explicit_budget,
            iteration_budget=iteration_budget,
            full=full,
            residuals=residuals,
            work_dtype=wd,
            basis_device=as_basis_device(basis_device),
        )

    def config(self, op: CurvatureOperator, seed: int | None, v0: str | None) -> dict[str, Any]:
        """The arguments a checkpoint must have been written with (``v0``: a digest of the
        start). See NOTE [resumable lanczos]."""
        config: dict[str, Any] = {
            "n": self.n,
            "op_dtype": str(op.dtype),
            "work_dtype": str(self.work_dtype),
            "k": self.k,
            "which": self.which,
            "tol": self.tol,
            "max_iter": self.max_iter if self.explicit_budget else None,
            "ncv": self.ncv,
            "block_size": self.block_size,
            "reorthogonalize": self.full,
            "residuals": self.residuals,
            "seed": seed,
            "v0": v0,
        }
        if self.basis_device is not None:  # sums over panels of this width: See NOTE [basis off
            # the device]; a key that only such files have (load_checkpoint refuses it elsewhere)
            rows = self.ncv + self.block
            config["basis_panel"] = panel_width(rows, self.n_local, self.work_dtype, CHUNK_BYTES)
        return config


class KrylovState:
    """A thick-restart Lanczos iteration between two steps.

    The basis ``V (ncv + b, n)`` in the working dtype, a :class:`~.basis.KrylovBasis` on the
    operator's device or streamed from ``plan.basis_device`` (NOTE [basis off the device]; ``Vn``:
    its numpy view when steps run on the host, NOTE [small operators on the host]); the projected matrix ``T`` and every
    product's projections ``Hf`` on the host in float64 (NOTE [recorded residuals]); rows
    ``[0, restart_l)`` are the Ritz vectors kept at the last restart and ``V[j : j + b]`` is
    the block expanded next. ``theta``, ``S``, ``est``, ``order`` are the Ritz data of the
    last check.
    """

    def __init__(
        self,
        plan: LanczosPlan,
        op: CurvatureOperator,
        backend: LinAlgBackend,
        gen: torch.Generator,
        start: torch.Tensor | None,
    ) -> None:
        """A fresh iteration from the orthonormal ``start`` block ``(b, n)`` (``None``: rows
        left for ``from_checkpoint`` to fill)."""
        b, m, wd = plan.block, plan.ncv, plan.work_dtype
        self.plan, self.op, self.backend, self.gen = plan, op, backend, gen
        self.n, self.full = plan.n, plan.full  # read by the steps
        self.basis: KrylovBasis = new_basis(m + b, plan.n_local, wd, op.device, plan.basis_device)
        self.T = np.zeros((m + b, m + b))
        # See NOTE [recorded residuals]: every product's projections (Hf) and a bound of the
        # parts of products that restarts dropped (lost[0])
        self.Hf = np.zeros((m + b, m + b))
        self.lost = np.zeros(1)
        if start is not None:
            self.basis.write(0, start)
        self.noise = rounding_level(wd, op.dtype)
        self.eps = float(torch.finfo(wd).eps)
        # See NOTE [small operators on the host]
        self.Vn = self.basis.host_view(backend) if b == 1 else None
        self.R1 = np.zeros((1, 1))  # the host step's R
        # checks are skipped only where a step costs about as little as a check: small
        # operators whose vectors live in host memory (NOTE [ritz check schedule])
        self.scheduled = (
            op.device.type == "cpu" and (m + b) * plan.n_local <= HOST_ARITHMETIC_MAX_NUMEL
        )
        self.j = 0  # first row of the block being expanded
        self.restart_l = 0  # rows [0, restart_l) are kept Ritz vectors of the last restart
        self.top = b
        self.products = 0
        self.it = 0
        self.anorm = 0.0
        self.exhausted = False
        self.last_step = False
        self.Rh = np.zeros((b, b))  # the coupling of the last step's new block
        self.theta = np.zeros(0)
        self.S = np.zeros((0, 0))
        self.est = np.zeros(0)
        self.order = np.zeros(0, dtype=np.int64)
        self.n_conv = 0
        self.next_check = 0  # products at which the next Ritz check is due
        self.last_check: tuple[int, float] | None = None  # (products, worst est / threshold)

    def step(self) -> None:
        """Expand the basis by the block ``V[j : j + b]``: one product of ``b`` vectors and
        the step's one host sync."""
        b = self.plan.block
        self.it += 1
        self.top = self.j + b
        lo = 0 if (self.full or self.j == self.restart_l) else max(0, self.j - b)
        self.products += b
        if self.Vn is not None:
            self.Rh, self.anorm, self.exhausted = _host_step(
                self, self.j, lo, self.anorm, self.products
            )
        else:
            self.Rh, self.anorm, self.exhausted = _device_step(
                self, self.j, lo, b, self.anorm, self.products
            )
        self.last_step = self.products + b > self.plan.iteration_budget

    def check_due(self) -> bool:
        """Whether this step checks the Ritz pairs: See NOTE [ritz check schedule]. A restart
        and the last step need them (forced)."""
        return (self.top >= self.plan.k or self.exhausted) and (
            self.products >= self.next_check
            or self.exhausted
            or self.last_step
            or self.top + self.plan.block > self.plan.ncv
        )

    def check(self) -> bool:
        """Ritz pairs of the current basis and their residual estimates; schedules the next
        check. Returns whether the iteration is done (the ``k`` wanted pairs met ``tol``, or
        the Krylov space is exhausted)."""
        plan, top, b = self.plan, self.top, self.plan.block
        self.theta, self.S = np.linalg.eigh(self.T[:top, :top])
        self.anorm = max(self.anorm, float(np.abs(self.theta).max()))
        if self.exhausted:
            self.est = np.zeros(top)
        elif b == 1:
            self.est = np.abs(self.Rh[0, 0] * self.S[top - 1])
        else:
            self.est = np.linalg.norm(self.Rh @ self.S[top - b : top, :], axis=0)
        self.order = ritz_order(self.theta, plan.which)
        want = self.order[: plan.k]
        thresh = np.maximum(plan.tol * np.abs(self.theta[want]), self.noise * self.anorm)
        ratio = float(np.max(self.est[want] / np.maximum(thresh, _TINY)))
        self.n_conv = int((self.est[want] <= thresh).sum())
        # with exactly k Ritz values every one is "wanted": insist on one more to compare
        if self.exhausted or (top > plan.k and self.n_conv == plan.k):
            return True
        gap = check_gap(ratio, self.products, self.last_check, b) if self.scheduled else b
        self.next_check = self.products + gap
        self.last_check = (self.products, ratio)
        return False

    def advance(self) -> bool:
        """Move on to the block the step made, or restart when the basis is full; returns
        whether it restarted."""
        if self.top + self.plan.block <= self.plan.ncv:
            self.j = self.top
            return False
        self.restart()
        return True

    def restart(self) -> None:
        """Thick restart: keep the most wanted Ritz vectors and the residual block (from the
        Ritz check of this step, which a restart always makes)."""
        plan, top, b, S = self.plan, self.top, self.plan.block, self.S
        n_keep = _num_kept(plan.k, plan.ncv, b, self.n_conv)
        keep = self.order[:n_keep]
        if self.Vn is not None:  # See NOTE [small operators on the host]
            self.Vn[:n_keep] = S[:, keep].T.astype(self.Vn.dtype) @ self.Vn[:top]
            self.Vn[n_keep] = self.Vn[top]
        else:
            Sk = torch.from_numpy(np.ascontiguousarray(S[:, keep].T)).to(
                device=self.op.device, dtype=plan.work_dtype
            )
            self.basis.restart(Sk, top, b)
        coupling = self.Rh @ S[top - b : top, keep]
        _restart_record(self.Hf, self.lost, S[:, keep], top, b, self.noise * self.anorm)
        T = self.T
        T[:] = 0.0
        T[:n_keep, :n_keep] = np.diag(self.theta[keep])
        T[n_keep : n_keep + b, :n_keep] = coupling
        T[:n_keep, n_keep : n_keep + b] = coupling.T
        self.j = n_keep
        self.restart_l = n_keep

    def result(self) -> EigenResult:
        """The ``k`` most wanted Ritz pairs of the last check, their residuals by the plan's
        policy (``"exact"``: ``k`` more products) and convergence flags."""
        plan, op, wd, top = self.plan, self.op, self.plan.work_dtype, self.top
        want = self.order[: plan.k]
        S = torch.from_numpy(np.ascontiguousarray(self.S[:, want].T))
        Y = self.basis.combine(S.to(device=op.device, dtype=wd), 0, top)
        lam = torch.from_numpy(self.theta[want].copy())
        if plan.residuals == "exact":
            # a streamed basis' Ritz vectors are in host memory: to the device a block at a time
            rows = plan.block if self.basis.streamed else plan.k
            res = torch.cat(
                [_exact_residuals(op, self.backend, Y[i : i + rows], lam[i : i + rows])
                 for i in range(0, plan.k, rows)]
            )  # fmt: skip
            self.products += plan.k
            if not bool(torch.isfinite(res).all()):
                raise non_finite_error("residual check", self.it)
        elif plan.residuals == "recorded":
            product_rounding = float(torch.finfo(op.dtype).eps) * self.anorm
            Sw, est = self.S[:, want], self.est[want]
            recorded = _recorded_residuals(
                self.Hf, self.T, self.lost, Sw, est, top, product_rounding
            )
            res = torch.from_numpy(recorded)
        else:
            res = torch.from_numpy(self.est[want].copy())
        floor = self.noise * self.anorm  # See NOTE [convergence rule] in result
        return EigenResult(
            eigenvalues=lam,
            eigenvectors=Y.to(op.dtype),
            residuals=res,
            iterations=self.products,
            converged=res <= torch.clamp(plan.tol * lam.abs(), min=floor),
            tol=float(plan.tol),
            residual_floor=floor,
        )

    def warn_unconverged(self, result: EigenResult) -> None:
        """A ``ConvergenceWarning`` when not every pair converged, saying what to change."""
        plan = self.plan
        if bool(result.converged.all()):
            return
        hint = "raise max_iter or ncv, or loosen tol"
        thresh = torch.clamp(plan.tol * result.eigenvalues.abs(), min=result.residual_floor)
        est = torch.from_numpy(self.est[self.order[: plan.k]].copy())
        if plan.residuals != "estimate" and bool((est <= thresh).all()):
            causes = self.op.inconsistency_causes()
            hint = (
                "the Ritz estimates met tol but the recomputed residuals "
                + ("(from the products made) " if plan.residuals == "recorded" else "")
                + "did not, so the products are not consistent at that level"
                + (
                    f" ({'; '.join(causes)})"
                    if causes
                    else " (a product that is random or of low precision)"
                )
                + "; loosen tol"
            )
        warn_convergence(
            f"lanczos: {int(result.converged.sum())} of {plan.k} eigenpairs converged to "
            f"tol={plan.tol:g} within {result.iterations} products; {hint}"
        )

    def to_checkpoint(self) -> dict[str, Any]:
        """The iteration between two steps, as a checkpoint's ``state``: See NOTE [resumable
        lanczos]. Tensors are copies (a view would save the whole buffer)."""
        rows = self.j + self.plan.block
        state: dict[str, Any] = {
            "j": self.j,
            "restart_l": self.restart_l,
            "products": self.products,
            "it": self.it,
            "anorm": self.anorm,
            "next_check": self.next_check,
            "last_check": None if self.last_check is None else list(self.last_check),
            "V": self.basis.to_cpu(slice(0, rows)),
            "T": torch.from_numpy(self.T[:rows, :rows].copy()),
            "Hf": torch.from_numpy(self.Hf[:rows, :rows].copy()),
            "lost": torch.from_numpy(self.lost.copy()),
        }
        for name in ("theta", "S", "est", "order"):
            state[name] = torch.from_numpy(np.ascontiguousarray(getattr(self, name)))
        return state

    @classmethod
    def from_checkpoint(
        cls,
        state: dict[str, Any],
        plan: LanczosPlan,
        op: CurvatureOperator,
        backend: LinAlgBackend,
        gen: torch.Generator,
        path: Path,
    ) -> KrylovState:
        """The iteration ``to_checkpoint`` saved, in freshly allocated buffers (``gen``: already
        set to the saved generator state). Raises ``ValueError`` for an incomplete state."""
        run = cls(plan, op, backend, gen, None)
        loop = _restore(state, run.basis, run.T, run.Hf, run.lost, plan.block, path)
        run.j, run.restart_l, run.it = loop["j"], loop["restart_l"], loop["it"]
        run.products, run.anorm = loop["products"], loop["anorm"]
        run.theta, run.S, run.est, run.order = loop["theta"], loop["S"], loop["est"], loop["order"]
        run.next_check, run.last_check = loop["next_check"], loop["last_check"]
        return run


# NOTE [resumable lanczos]
# Between two steps the iteration is: the basis rows V[:j + b] (the kept Ritz vectors and the
# block to expand next; the rows past them are written before they are read), the projected
# matrix T (zero outside [:j + b, :j + b]), the counters (j, restart_l, products, steps), the
# norm estimate, the Ritz data of the last check with the check schedule (NOTE [ritz check
# schedule]) and the generator (fresh directions after an invariant subspace).
# `KrylovState.to_checkpoint` gives them to the file (NOTE [checkpoint files] in
# `_checkpoint`); `KrylovState.from_checkpoint` (through `_restore`) puts them back into
# freshly allocated buffers, after which every step computes what it computed in the call
# that wrote them: same shapes, same data, same operations, hence the same bits on the same
# device and versions. The default saves at thick restarts, where the basis is smallest
# (n_keep + b rows). The start vector is not needed to resume (it is row 0 of the basis at
# the start), but a different one would have given another run: the config holds a digest of
# `v0`. A finished call deletes the file rather than marking it: the common way to reuse a
# path is a loop over training steps, where returning the stored result of an older
# operator would be silently wrong; a resumed file of an older operator is the caller's to
# avoid (the file cannot tell operators of the same size apart).


def _restore(
    state: dict[str, Any],
    V: KrylovBasis,
    T: np.ndarray[Any, Any],
    Hf: np.ndarray[Any, Any],
    lost: np.ndarray[Any, Any],
    b: int,
    path: Path,
) -> dict[str, Any]:
    """Fill ``V``, ``T``, ``Hf`` and ``lost`` from a checkpoint's state; the loop variables, as
    ``KrylovState.to_checkpoint`` gave them."""
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
        if Vs.shape != (rows, V.n) or Vs.dtype != V.dtype or rows > V.rows:
            raise ValueError(
                f"a basis of shape {tuple(Vs.shape)} ({Vs.dtype}), expected ({rows}, {V.n}) ({V.dtype})"
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
    V.write(0, Vs)
    T[:rows, :rows] = Ts.numpy()
    Hf[:rows, :rows] = Hs.numpy()
    lost[:] = Ls.numpy()
    return loop


_TINY = float(np.finfo(np.float64).tiny)


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


def _device_step(
    st: KrylovState, j: int, lo: int, b: int, anorm: float, products: int
) -> tuple[np.ndarray[Any, Any], float, bool]:
    """Expand the basis by the block ``V[j : j + b]``: one product, reorthogonalization
    against ``V[lo : j + b]``, the new block in ``V[j + b : j + 2b]`` and its couplings in
    ``T``. Returns the coupling ``R`` (host, ``(b, b)``), the updated norm estimate and
    whether the Krylov space is exhausted."""
    V, T, backend = st.basis, st.T, st.backend
    top = j + b
    W = apply_rows(st.op, V.read(j, top))
    H = V.inner(lo, top, W, backend)  # (top - lo, b)
    if st.full:
        W, H2 = V.subtract_inner(lo, top, H, W, backend)
        W = V.subtract(lo, top, H2, W)
        H = H + H2
    else:
        W = V.subtract(lo, top, H, W)
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
        Q = V.project_out(Q, top, backend)
        Q = Q / backend.norm(Q)
    if diag.min() <= st.noise * max(anorm, torch.finfo(torch.float64).tiny):
        # invariant subspace (or the whole space) reached: continue with a fresh
        # direction orthogonal to the basis; its coupling to the basis is W's
        Q, Rh, exhausted = _fresh_block(W, V, top, b, st.n, st.gen, backend)
    if not exhausted:
        V.write(top, Q)
        T[top : top + b, j:top] = Rh
        T[j:top, top : top + b] = Rh.T
        st.Hf[top : top + b, j:top] = Rh
    return Rh, anorm, exhausted


def _host_step(
    st: KrylovState, j: int, lo: int, anorm: float, products: int
) -> tuple[np.ndarray[Any, Any], float, bool]:
    """``_device_step`` for ``b = 1`` in numpy on the host view ``Vn`` of the basis
    (the same arithmetic and tests). See NOTE [small operators on the host]."""
    Vn, T = st.Vn, st.T
    if Vn is None:
        raise InternalError("Vn is not None")
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
            torch.from_numpy(w).unsqueeze(0), st.basis, top, 1, st.n, st.gen, st.backend
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


def _exact_residuals(
    op: CurvatureOperator, backend: LinAlgBackend, Y: torch.Tensor, lam: torch.Tensor
) -> torch.Tensor:
    """``||A y - λ y||`` (host, float64) of the Ritz pairs ``(λ, y)``: one product a row;
    ``Y`` moved to the operator's device when it is not there."""
    Y = Y.to(op.device)
    Rm = apply_rows(op, Y) - lam.to(device=Y.device, dtype=Y.dtype).unsqueeze(1) * Y
    return row_dots(backend, Rm, Rm).sqrt().to("cpu", torch.float64)


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
    basis: KrylovBasis,
    top: int,
    b: int,
    n: int,
    gen: torch.Generator,
    backend: LinAlgBackend,
) -> tuple[torch.Tensor, np.ndarray, bool]:
    """Orthonormal rows ``Q (b, n)`` spanning ``W``'s numerically nonzero part,
    completed by random directions orthogonal to the basis rows ``[0, top)``; ``W = Rᵀ Q``.

    Returns ``exhausted=True`` when the basis already spans the whole space
    (``n`` is the global length; vectors may be local shards).
    """
    if top + b > n:
        return W, np.zeros((b, b)), True
    Z = random_rows(b, W.shape[1], gen, device=W.device, dtype=W.dtype)
    for _ in range(2):
        Z = basis.project_out(Z, top, backend)
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
