"""Linear solves ``(A + λI) x = b`` with a curvature operator, and the inverse as an operator.

Math. Three Krylov-type iterations, all with one product of ``A + λI`` per
iteration:

- ``"cg"``, conjugate gradients, for symmetric positive definite ``A + λI``
  (a damped GGN or Fisher, a Hessian at a minimum plus damping). It minimises
  the ``(A + λI)``-norm of the error over the Krylov space. A direction with
  ``pᵀ(A + λI)p <= 0`` proves the matrix is not positive definite: that column
  stops with its last iterate and is reported (``negative_curvature``).
- ``"minres"`` for symmetric indefinite systems (a Hessian away from a
  minimum, shift-and-invert with a negative damping): it minimises the
  residual over the Krylov space through the Lanczos recurrence and a running
  QR factorisation of its tridiagonal matrix (NOTE [minres recurrences]).
- ``"neumann"``: ``(A + λI)⁻¹ = s Σᵢ (I - s(A + λI))ⁱ``, truncated. The
  partial sums are Richardson's iteration ``x ← x + s M⁻¹ r``. It converges
  if and only if the spectral radius of ``I - s M⁻¹(A + λI)`` is below 1; for
  symmetric positive definite ``A + λI`` and no preconditioner that means
  ``0 < s < 2 / λ_max(A + λI)`` (``s = 1 / λ_max`` is safe: take ``λ_max`` from
  ``lanczos(op, k=1, which="LA")``), and the residual shrinks by at most
  ``1 - s λ_min`` per iteration: slow unless ``A + λI`` is well conditioned.
  It is the series influence-function code uses (LiSSA without sampling).

Blocks. ``b`` may be a block ``(n, k)``: the ``k`` columns advance together
with one block product ``op @ V`` per iteration (one data pass for the data
operators), each with its own scalars. A column that converges or stops is
frozen and leaves the block, so later products are narrower. The one host
synchronisation per iteration reads every active column's residual and its
trouble flag together.

Preconditioning. ``preconditioner`` applies ``M⁻¹ ≈ (A + λI)⁻¹`` to residuals;
CG and MINRES need it symmetric positive definite.

Cost: ``iterations`` products per column plus, with ``x0``, one to form the
first residual and, with ``residuals="exact"``, one for the true residual at
the end; memory: about 4 (CG), 9 (MINRES) or 3 (Neumann) vectors per column.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, Literal

import torch

from hessian_eigenthings._checks import InternalError, check_count
from hessian_eigenthings.algorithms._common import (
    apply_rows,
    check_operator,
    global_size,
    non_finite_error,
    operator_backend,
    progress_bar,
    row_dots,
    work_dtype,
)
from hessian_eigenthings.algorithms.result import SolveResult, warn_convergence
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator, same_device

Method = Literal["cg", "minres", "neumann"]
Preconditioner = CurvatureOperator | Callable[[torch.Tensor], torch.Tensor]

__all__ = ["InverseOperator", "SolveResult", "inverse", "solve"]

_METHODS = ("cg", "minres", "neumann")

# per-column trouble codes of one iteration, read with the residuals in the one host sync
_OK, _NEGATIVE_CURVATURE, _PRECONDITIONER_NOT_PD, _EXHAUSTED, _DIVERGED = 0, 1, 2, 3, 4

# NOTE [neumann divergence]
# With a scale past 2/λ_max, or A + λI not positive definite, the Neumann residual grows
# geometrically. A column whose residual exceeds this multiple of its first one is stopped
# as diverged long before it overflows; a converging series never grows that much (for
# symmetric positive definite A + λI and no preconditioner its residual never grows at all).
_DIVERGENCE_GROWTH = 1e3

# iterations declared to the operator (`expect_products`) per column
_TYPICAL_ITERATIONS = 100


def _real(value: object, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def _check_options(
    op: CurvatureOperator,
    damping: object,
    method: object,
    tol: object,
    max_iter: object,
    preconditioner: object,
    scale: object,
    residuals: object,
) -> tuple[float, float, int | None, float | None]:
    """Validated ``(damping, tol, max_iter, scale)``; shared by :func:`solve` and :func:`inverse`."""
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    damping_f = _real(damping, "damping")
    tol_f = _real(tol, "tol")
    if tol_f <= 0:
        raise ValueError(f"tol must be > 0 (a relative residual, e.g. 1e-6), got {tol_f}")
    max_iter_i = check_count("max_iter", max_iter, allow_none=True)
    if residuals not in ("exact", "estimate"):
        raise ValueError(f"residuals must be 'exact' or 'estimate', got {residuals!r}")
    scale_f: float | None = None
    if method == "neumann":
        if scale is None:
            raise ValueError(
                "method='neumann' needs scale=s with 0 < s < 2 / λ_max(A + λI) for the series to "
                "converge; s = 1 / λ_max is safe: λ_max = float(he.lanczos(op, k=1, which='LA')"
                ".eigenvalues[0]) + damping"
            )
        scale_f = _real(scale, "scale")
        if scale_f <= 0:
            raise ValueError(f"scale must be > 0 (about 1 / λ_max(A + λI)), got {scale_f}")
    elif scale is not None:
        raise ValueError(f"scale is used by method='neumann' only; drop it for method={method!r}")
    if preconditioner is not None:
        if isinstance(preconditioner, CurvatureOperator):
            if preconditioner.size != op.size:
                raise ValueError(
                    f"the preconditioner has size {preconditioner.size}, the operator {op.size}"
                )
        elif not callable(preconditioner):
            raise TypeError(
                "preconditioner must be a CurvatureOperator or a callable r -> M⁻¹ r, got "
                f"{type(preconditioner).__name__}"
            )
    return damping_f, tol_f, max_iter_i, scale_f


def _check_rhs(op: CurvatureOperator, t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (1, 2) or t.shape[0] != op.size:
        raise ValueError(
            f"{name} must have shape ({op.size},) or ({op.size}, k), got {tuple(t.shape)}"
        )
    if t.dtype != op.dtype:
        raise TypeError(
            f"{name} has dtype {t.dtype} but the operator works in {op.dtype}; pass {name}.to({op.dtype})"
        )
    if not same_device(t.device, op.device):
        raise ValueError(
            f"{name} is on {t.device} but the operator is on {op.device}; pass {name}.to('{op.device}')"
        )
    return t


class _System:
    """``A + λI`` and ``M⁻¹`` on row blocks ``(k, n)`` in the working dtype, counting products."""

    def __init__(
        self,
        op: CurvatureOperator,
        damping: float,
        preconditioner: Preconditioner | None,
        vector: bool,
        wd: torch.dtype,
        backend: LinAlgBackend,
        bar: Any,
    ) -> None:
        self.op, self.damping, self.pre, self.vector = op, damping, preconditioner, vector
        self.wd, self.backend, self.bar = wd, backend, bar
        self.products = 0

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        out = apply_rows(self.op, X)
        if self.damping != 0.0:
            out.add_(X, alpha=self.damping)
        self.products += X.shape[0]
        self.bar.update(X.shape[0])
        return out

    def precondition(self, R: torch.Tensor) -> torch.Tensor:
        """``M⁻¹`` on each row; the identity (no copy) without a preconditioner."""
        pre = self.pre
        if pre is None:
            return R
        if isinstance(pre, CurvatureOperator):
            return apply_rows(pre, R).to(self.wd)
        # a callable sees residuals as the caller sees b: a vector (n,) or a block (n, k)
        arg = R[0] if self.vector else R.T
        out = pre(arg)
        if not isinstance(out, torch.Tensor) or out.shape != arg.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"the preconditioner must return a tensor shaped like its input {tuple(arg.shape)}, got {got}"
            )
        out = out.to(self.wd)
        return out.unsqueeze(0) if self.vector else out.T

    def dots(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return row_dots(self.backend, A, B)

    def norms(self, A: torch.Tensor) -> torch.Tensor:
        return row_dots(self.backend, A, A).clamp_min(0).sqrt()


# Each method keeps its state as a dict of tensors whose first dimension is the active
# columns; `step` advances every active column once and returns (residual norms, codes).
State = dict[str, torch.Tensor]


def _cg_start(sys_: _System, state: State) -> torch.Tensor:
    r = state["r"]
    z = sys_.precondition(r)
    state["p"] = z.clone()  # p is updated in place of r's memory otherwise (z is r without M)
    state["rz"] = sys_.dots(r, z)
    return torch.where(state["rz"] <= 0, _PRECONDITIONER_NOT_PD, _OK)


def _cg_step(sys_: _System, state: State) -> tuple[torch.Tensor, torch.Tensor]:
    x, r, p, rz = state["x"], state["r"], state["p"], state["rz"]
    Ap = sys_.apply(p)
    pAp = sys_.dots(p, Ap)
    # no sync to test the curvature first: a column with pᵀAp <= 0 takes no step (alpha = 0),
    # and the host stops it after this iteration's one read
    positive = pAp > 0
    alpha = torch.where(positive, rz / torch.where(positive, pAp, 1.0), 0.0)
    x.addcmul_(alpha.unsqueeze(1), p)
    r.addcmul_(alpha.unsqueeze(1), Ap, value=-1.0)
    z = sys_.precondition(r)
    rz_new = sys_.dots(r, z)
    beta = rz_new / torch.where(rz > 0, rz, 1.0)
    state["p"] = z + beta.unsqueeze(1) * p
    state["rz"] = rz_new
    res = sys_.norms(r)
    code = torch.where(
        ~positive, _NEGATIVE_CURVATURE, torch.where(rz_new <= 0, _PRECONDITIONER_NOT_PD, _OK)
    )
    return res, code


# NOTE [minres recurrences]
# Paige and Saunders (1975). Preconditioned Lanczos with M = C Cᵀ runs on C⁻¹(A + λI)C⁻ᵀ
# without forming C: it keeps z-space vectors w_j (residual space) and v_j = M⁻¹ w_j (solution
# space) with (A + λI) v_j = β_{j+1} w_{j+1} + α_j w_j + β_j w_{j-1}, α_j = v_jᵀ(A + λI)v_j and
# β_{j+1}² = z_{j+1}ᵀ M⁻¹ z_{j+1} for z_{j+1} = β_{j+1} w_{j+1} (without M, w_j = v_j).
# In that basis x_j = x_0 + V_j y with y minimising ||β_1 e_1 - T̄_j y|| for the (j+1) × j
# tridiagonal T̄_j. Givens rotations G_1 … G_j reduce T̄_j to upper triangular R (diagonal γ,
# superdiagonals δ, ε); column j of T̄ only meets G_{j-2}, G_{j-1} and the new G_j, so each step
# needs the last two rotations (c, s) and the last two directions d = V R⁻¹:
#   ε_j = s_{j-2} β_j,   δ_j = c_{j-1} c_{j-2} β_j + s_{j-1} α_j,
#   γ̄_j = c_{j-1} α_j - s_{j-1} c_{j-2} β_j,   γ_j = (γ̄_j² + β_{j+1}²)^½,
#   c_j = γ̄_j / γ_j,  s_j = β_{j+1} / γ_j,  τ_j = c_j φ̄_{j-1},  φ̄_j = -s_j φ̄_{j-1},
#   d_j = (v_j - δ_j d_{j-1} - ε_j d_{j-2}) / γ_j,   x_j = x_{j-1} + τ_j d_j.
# |φ̄_j| is the residual in the M⁻¹-norm. The 2-norm residual, which `tol` is about for every
# method, follows from r_j = φ̄_j W_{j+1} Q_jᵀ e_{j+1} (Q_j the product of the rotations):
#   r_j = s_j² r_{j-1} - (c_j φ̄_{j-1} / γ_j) z_{j+1},
# one more vector per column and no product. β_{j+1} = 0 means the Krylov space is exhausted:
# the column has its final iterate (exact for a consistent system).


def _minres_start(sys_: _System, state: State) -> torch.Tensor:
    r = state["r"]
    q = sys_.precondition(r)
    beta2 = sys_.dots(r, q)
    beta1 = beta2.clamp_min(0).sqrt()
    inv = 1.0 / torch.where(beta1 > 0, beta1, 1.0)
    zeros = torch.zeros_like(r)
    state.update(
        v=q * inv.unsqueeze(1),
        w_old=zeros,
        v_old=zeros,
        d1=zeros,
        d2=zeros,
        beta=torch.zeros_like(beta1),
        c1=torch.ones_like(beta1),
        s1=torch.zeros_like(beta1),
        c2=torch.ones_like(beta1),
        s2=torch.zeros_like(beta1),
        phibar=beta1,
    )
    state["w"] = state["v"] if sys_.pre is None else r * inv.unsqueeze(1)
    return torch.where(beta2 < 0, _PRECONDITIONER_NOT_PD, _OK)


def _minres_step(sys_: _System, state: State) -> tuple[torch.Tensor, torch.Tensor]:
    v, w, beta = state["v"], state["w"], state["beta"]
    c1, s1, c2, s2, phibar = state["c1"], state["s1"], state["c2"], state["s2"], state["phibar"]
    Av = sys_.apply(v)
    alpha = sys_.dots(v, Av)
    z = Av.addcmul_(alpha.unsqueeze(1), w, value=-1.0).addcmul_(
        beta.unsqueeze(1), state["w_old"], value=-1.0
    )
    q = sys_.precondition(z)
    beta2 = sys_.dots(z, q)
    beta_next = beta2.clamp_min(0).sqrt()
    # the QR update of column j of T̄ (NOTE [minres recurrences])
    eps = s2 * beta
    dbar = c2 * beta
    delta = c1 * dbar + s1 * alpha
    gbar = c1 * alpha - s1 * dbar
    gamma = torch.hypot(gbar, beta_next)
    gamma_safe = torch.where(gamma > 0, gamma, 1.0)
    c, s = gbar / gamma_safe, beta_next / gamma_safe
    tau = c * phibar
    d = (
        v - delta.unsqueeze(1) * state["d1"] - eps.unsqueeze(1) * state["d2"]
    ) / gamma_safe.unsqueeze(1)
    state["x"].addcmul_(tau.unsqueeze(1), d)
    r = state["r"]
    r.mul_((s * s).unsqueeze(1)).addcmul_((c * phibar / gamma_safe).unsqueeze(1), z, value=-1.0)
    inv = 1.0 / torch.where(beta_next > 0, beta_next, 1.0)
    state.update(
        d2=state["d1"],
        d1=d,
        c2=c1,
        s2=s1,
        c1=c,
        s1=s,
        phibar=-s * phibar,
        v_old=v,
        w_old=w,
        beta=beta_next,
        v=q * inv.unsqueeze(1),
    )
    state["w"] = state["v"] if sys_.pre is None else z * inv.unsqueeze(1)
    res = sys_.norms(r)
    # β_{j+1} at rounding level of the step's size: the Krylov space is exhausted
    exhausted = beta_next <= 10 * torch.finfo(sys_.wd).eps * (alpha.abs() + beta)
    code = torch.where(beta2 < 0, _PRECONDITIONER_NOT_PD, torch.where(exhausted, _EXHAUSTED, _OK))
    return res, code


def _neumann_start(sys_: _System, state: State) -> torch.Tensor:
    state["res0"] = sys_.norms(state["r"])
    return torch.zeros_like(state["res0"], dtype=torch.int64)


def _neumann_step(sys_: _System, state: State, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    u = sys_.precondition(state["r"]) * scale
    Au = sys_.apply(u)
    state["x"].add_(u)
    state["r"].sub_(Au)
    res = sys_.norms(state["r"])
    code = torch.where(
        res > _DIVERGENCE_GROWTH * state["res0"], _DIVERGED, _OK
    )  # NOTE [neumann divergence]
    return res, code


def solve(
    op: CurvatureOperator,
    b: torch.Tensor,
    *,
    damping: float = 0.0,
    method: Method = "cg",
    tol: float = 1e-6,
    max_iter: int | None = None,
    preconditioner: Preconditioner | None = None,
    x0: torch.Tensor | None = None,
    scale: float | None = None,
    residuals: Literal["exact", "estimate"] = "exact",
    progress: bool | None = None,
) -> SolveResult:
    """Solve ``(A + damping·I) x = b`` for a vector ``b (n,)`` or a block ``b (n, k)``.

    Args:
        damping: ``λ`` added to the diagonal (any real; CG needs ``A + λI`` positive definite).
        method: ``"cg"`` (symmetric positive definite), ``"minres"`` (symmetric, indefinite
            allowed) or ``"neumann"`` (truncated Neumann series; needs ``scale``).
        tol: a column has converged when ``||b - (A + λI)x|| <= tol · ||b||``.
        max_iter: iterations per column, each one product (default ``min(10 n, 10000)``).
        preconditioner: ``M⁻¹ ≈ (A + λI)⁻¹`` applied to residuals; symmetric positive
            definite for CG and MINRES. A ``CurvatureOperator``, or a callable that takes the
            residuals shaped as ``b`` is: a vector ``(n,)``, or a block ``(n, k')`` of the
            columns still running; e.g. Jacobi ``lambda R: R / d[:, None]`` for the diagonal
            ``d`` of ``A + λI`` (``he.diagonal`` estimates it).
        x0: start ``(n,)`` / ``(n, k)`` like ``b`` (default zero; costs one block product).
        scale: the Neumann step ``s``: the series converges iff the spectral radius of
            ``I - s M⁻¹(A + λI)`` is below 1; without a preconditioner and for positive
            definite ``A + λI`` that is ``0 < s < 2 / λ_max(A + λI)``.
        residuals: ``"exact"`` recomputes every column's residual with one block product at
            the end (what ``converged`` is judged on); ``"estimate"`` reports the recursive
            residual, no product.
        progress: ``True`` a tqdm bar, ``False`` nothing, ``None`` a bar on a terminal.

    Returns a :class:`SolveResult` with ``x`` shaped like ``b`` in the working dtype (the
    operator's for float32/float64, float32 for half types). Warns
    :class:`ConvergenceWarning` when a column does not converge, saying why (budget,
    negative curvature, a preconditioner that is not positive definite, an exhausted Krylov
    space, a diverging Neumann series, or a true residual that rounding keeps above ``tol``).
    Raises ``ValueError`` when a product returns non-finite values.
    """
    op = check_operator(op)
    damping_f, tol_f, max_iter_i, scale_f = _check_options(
        op, damping, method, tol, max_iter, preconditioner, scale, residuals
    )
    b = _check_rhs(op, b, "b")
    if x0 is not None:
        x0 = _check_rhs(op, x0, "x0")
        if x0.shape != b.shape:
            raise ValueError(f"x0 must have the shape of b {tuple(b.shape)}, got {tuple(x0.shape)}")
    vector = b.dim() == 1
    n = op.size
    k = 1 if vector else int(b.shape[1])
    budget = max_iter_i if max_iter_i is not None else min(10 * global_size(op), 10_000)
    backend = operator_backend(op, None)
    wd = work_dtype(op, None)
    B = (b.unsqueeze(0) if vector else b.T).to(wd)
    X_out = torch.zeros(k, n, dtype=wd, device=op.device)
    recursive = torch.zeros(k, dtype=torch.float64)
    codes = [_OK] * k
    if k == 0:
        return _result(X_out, vector, recursive, 0, torch.zeros(0, dtype=torch.bool), 0, codes)
    # a typical run, not the budget: a solve that needs its whole max_iter has gone wrong, and
    # declaring thousands of products would have engine="auto" compile for a 30-iteration solve
    op.expect_products(min(budget, _TYPICAL_ITERATIONS) * k)
    with progress_bar(budget * k, f"solve ({method})", progress) as bar:
        sys_ = _System(op, damping_f, preconditioner, vector, wd, backend, bar)
        bnorm = sys_.norms(B).to("cpu", torch.float64)
        if not bool(torch.isfinite(bnorm).all()):
            raise ValueError("b has non-finite entries")
        # a zero right-hand side has the solution zero: nothing to iterate
        cols = [j for j in range(k) if bnorm[j] > 0]
        idx = torch.as_tensor(cols, dtype=torch.int64, device=op.device)
        state: State = {}
        if x0 is None:
            state["x"] = torch.zeros(len(cols), n, dtype=wd, device=op.device)
            state["r"] = B[idx].clone()
        elif cols:
            X0 = (x0.unsqueeze(0) if vector else x0.T).to(wd)[idx].clone()
            state["x"] = X0
            state["r"] = B[idx] - sys_.apply(X0)
        iterations = 0
        if cols:
            start = {"cg": _cg_start, "minres": _minres_start, "neumann": _neumann_start}[method]
            code0 = start(sys_, state)
            res = sys_.norms(state["r"])
            cols, state = _freeze(cols, state, res, code0, bnorm, tol_f, X_out, recursive, codes, 0)
        while cols and iterations < budget:
            iterations += 1
            if method == "cg":
                res, code = _cg_step(sys_, state)
            elif method == "minres":
                res, code = _minres_step(sys_, state)
            else:
                if scale_f is None:
                    raise InternalError("scale_f is not None")
                res, code = _neumann_step(sys_, state, scale_f)
            cols, state = _freeze(
                cols, state, res, code, bnorm, tol_f, X_out, recursive, codes, iterations
            )
            if cols:
                bar.set_postfix(residual=f"{max(float(recursive[j]) for j in cols):.1e}")
        if cols:  # columns out of budget keep their last iterate
            X_out[torch.as_tensor(cols, dtype=torch.int64, device=op.device)] = state["x"]
        products = sys_.products
        if residuals == "exact":
            R = B - sys_.apply(X_out)
            true = sys_.norms(R).to("cpu", torch.float64)
            if not bool(torch.isfinite(true).all()):
                raise non_finite_error("final residual", iterations)
            final = torch.where(
                bnorm > 0, true / bnorm.clamp_min(torch.finfo(torch.float64).tiny), 0.0
            )
            products = sys_.products
        else:
            final = recursive
        converged = final <= tol_f
    _warn(method, final, converged, recursive, codes, tol_f, budget, residuals == "exact", wd)
    return _result(X_out, vector, final, iterations, converged, products, codes)


def _freeze(
    cols: list[int],
    state: State,
    res: torch.Tensor,
    code: torch.Tensor,
    bnorm: torch.Tensor,
    tol: float,
    X_out: torch.Tensor,
    recursive: torch.Tensor,
    codes: list[int],
    iteration: int,
) -> tuple[list[int], State]:
    """Read the active columns' residuals and codes (the iteration's one host sync), record the
    ones that stop, and drop them from the state."""
    host = torch.stack([res.to(torch.float64), code.to(torch.float64)], dim=1).cpu()
    keep: list[int] = []
    for i, j in enumerate(cols):
        rel = float(host[i, 0]) / float(bnorm[j])
        if not math.isfinite(rel):
            raise non_finite_error(f"residual of column {j}", iteration)
        recursive[j] = rel
        c = int(host[i, 1])
        if c == _NEGATIVE_CURVATURE or rel <= tol or c != _OK:
            codes[j] = _OK if (rel <= tol and c != _NEGATIVE_CURVATURE) else c
            X_out[j] = state["x"][i]
        else:
            keep.append(i)
    if len(keep) == len(cols):
        return cols, state
    sel = torch.as_tensor(keep, dtype=torch.int64, device=res.device)
    return [cols[i] for i in keep], {name: t[sel] for name, t in state.items()}


def _result(
    X: torch.Tensor,
    vector: bool,
    residual_norms: torch.Tensor,
    iterations: int,
    converged: torch.Tensor,
    products: int,
    codes: list[int],
) -> SolveResult:
    return SolveResult(
        x=X[0] if vector else X.T,
        residual_norms=residual_norms,
        iterations=iterations,
        converged=converged,
        num_matvecs=products,
        negative_curvature=torch.tensor(
            [c == _NEGATIVE_CURVATURE for c in codes], dtype=torch.bool
        ),
    )


def _columns(js: list[int]) -> str:
    shown = ", ".join(str(j) for j in js[:8])
    return f"column{'s' if len(js) > 1 else ''} {shown}{', ...' if len(js) > 8 else ''}"


def _warn(
    method: str,
    final: torch.Tensor,
    converged: torch.Tensor,
    recursive: torch.Tensor,
    codes: list[int],
    tol: float,
    budget: int,
    exact: bool,
    wd: torch.dtype,
) -> None:
    failed = [j for j in range(len(codes)) if not bool(converged[j])]
    if not failed:
        return
    k = len(codes)
    by = {
        c: [j for j in failed if codes[j] == c]
        for c in (_NEGATIVE_CURVATURE, _PRECONDITIONER_NOT_PD, _EXHAUSTED, _DIVERGED)
    }
    stalled = [j for j in failed if codes[j] == _OK and float(recursive[j]) <= tol]
    budget_out = [j for j in failed if codes[j] == _OK and j not in stalled]
    parts = [
        f"solve (method={method!r}): {len(failed)} of {k} column{'s' if k > 1 else ''} did not reach "
        f"tol={tol:g} (largest relative residual {float(final[failed].max()):.2e})"
    ]
    if budget_out:
        parts.append(
            f"{_columns(budget_out)}: max_iter={budget} ran out; raise max_iter, add a preconditioner "
            "or more damping (a better conditioned system)"
        )
    if by[_NEGATIVE_CURVATURE]:
        parts.append(
            f"{_columns(by[_NEGATIVE_CURVATURE])}: CG met a direction with pᵀ(A + λI)p <= 0, so A + λI is "
            "not positive definite (see result.negative_curvature); use method='minres' for an "
            "indefinite system, or a damping above -λ_min(A)"
        )
    if by[_PRECONDITIONER_NOT_PD]:
        parts.append(
            f"{_columns(by[_PRECONDITIONER_NOT_PD])}: the preconditioner is not positive definite "
            "(rᵀM⁻¹r <= 0); CG and MINRES need a symmetric positive definite M⁻¹"
        )
    if by[_EXHAUSTED]:
        parts.append(
            f"{_columns(by[_EXHAUSTED])}: the Krylov space is exhausted above tol: A + λI is singular and "
            "b is not in its range (x minimises the residual there); add damping"
        )
    if by[_DIVERGED]:
        parts.append(
            f"{_columns(by[_DIVERGED])}: the Neumann series diverges: it needs the spectral radius of "
            "I - scale·M⁻¹(A + λI) below 1 (A + λI positive definite and scale < 2 / λ_max(A + λI))"
        )
    if stalled and exact:
        parts.append(
            f"{_columns(stalled)}: the recursive residual met tol but the true one did not: rounding in "
            f"{str(wd).removeprefix('torch.')} limits the attainable residual to about eps·cond(A + λI); "
            "solve in float64, add damping, or loosen tol"
        )
    warn_convergence("; ".join(parts))


class InverseOperator(CurvatureOperator):
    """``(A + λI)⁻¹`` as an operator: every product is a :func:`solve` (what :func:`inverse`
    returns). A block is solved as one block (its columns advance together).

    The products are iterative solves to ``tol``: linear and symmetric to about that accuracy,
    not exactly. For an algorithm that relies on exact linearity (Lanczos on the inverse),
    pass a tight ``tol``. ``last_result`` holds the :class:`SolveResult` of the last product.
    """

    def __init__(
        self, op: CurvatureOperator, damping: float, method: Method, solve_kwargs: dict[str, Any]
    ) -> None:
        self.op = op
        self.damping = damping
        self.method = method
        self.solve_kwargs = solve_kwargs
        self.last_result: SolveResult | None = None
        self._size = op.size
        self._device = op.device
        self._dtype = op.dtype
        if hasattr(op, "backend"):
            self.backend = op.backend
        if hasattr(op, "global_size"):
            self.global_size = op.global_size
        if hasattr(op, "layout"):
            self.layout = op.layout  # the same parameters: the curvlinops adapter reads it

    def _solve(self, b: torch.Tensor) -> torch.Tensor:
        result = solve(self.op, b, damping=self.damping, method=self.method, **self.solve_kwargs)
        self.last_result = result
        return result.x.to(self.dtype)

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self._solve(v)

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        return self._solve(V.T).T

    def inconsistency_causes(self) -> list[str]:
        tol = self.solve_kwargs.get("tol", 1e-6)
        return [
            *self.op.inconsistency_causes(),
            f"products of the inverse are iterative solves, accurate to a relative residual of tol={tol:g}",
        ]

    def __repr__(self) -> str:
        return f"InverseOperator(({self.op!r} + {self.damping:g}·I)⁻¹, method={self.method!r})"


def inverse(
    op: CurvatureOperator, damping: float, method: Method = "cg", **solve_kwargs: Any
) -> InverseOperator:
    """``(A + damping·I)⁻¹`` as a :class:`CurvatureOperator`: each product runs :func:`solve`
    with ``method`` and ``solve_kwargs`` (``tol``, ``max_iter``, ``preconditioner``, ``scale``,
    ``residuals``, ``progress``; default ``progress=False``). Arguments are checked here, not
    at the first product."""
    op = check_operator(op)
    if "x0" in solve_kwargs:
        raise TypeError("inverse() takes no x0: every product starts from zero")
    unknown = set(solve_kwargs) - {
        "tol",
        "max_iter",
        "preconditioner",
        "scale",
        "residuals",
        "progress",
    }
    if unknown:
        raise TypeError(f"inverse() got unexpected keyword arguments {sorted(unknown)}")
    kwargs = {"progress": False, **solve_kwargs}
    damping_f, _, _, _ = _check_options(
        op,
        damping,
        method,
        kwargs.get("tol", 1e-6),
        kwargs.get("max_iter"),
        kwargs.get("preconditioner"),
        kwargs.get("scale"),
        kwargs.get("residuals", "exact"),
    )
    return InverseOperator(op, damping_f, method, kwargs)
