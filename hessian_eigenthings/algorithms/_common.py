"""Plumbing shared by the algorithms: validation, random probes, precision,
progress bars and block orthonormalization through the linear-algebra backend.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from hessian_eigenthings._checks import check_count
from hessian_eigenthings.linalg import LinAlgBackend, SingleDeviceBackend, default_backend
from hessian_eigenthings.memory import available_memory
from hessian_eigenthings.operators.protocol import CurvatureOperator

_NON_FINITE_HINT = (
    "usual causes: a NaN/inf loss or gradient for some batch, fp16 overflow "
    "(try bfloat16 or float32), or a finite-difference step that is too small"
)


def operator_backend(op: CurvatureOperator, backend: LinAlgBackend | None) -> LinAlgBackend:
    """``backend`` when given, else the operator's own (``op.backend``: a sharded operator's
    distributed backend), else the single-device one."""
    return default_backend(backend if backend is not None else getattr(op, "backend", None))


def check_operator(op: Any) -> CurvatureOperator:
    if not isinstance(op, CurvatureOperator):
        raise TypeError(
            f"expected a CurvatureOperator (e.g. LambdaOperator(matvec_fn, size)); got {type(op).__name__}"
        )
    return op


def global_size(op: CurvatureOperator) -> int:
    """Length of the whole vector: ``op.global_size`` for a sharded operator, else ``op.size``.

    Caps that depend on the matrix dimension (``k``, ``ncv``, Krylov depth,
    sketch sizes) use it; vectors stay local (``op.size``).
    """
    return int(getattr(op, "global_size", op.size))


def apply_blocks(
    op: CurvatureOperator, X: torch.Tensor, block_size: int | None, bar: object
) -> torch.Tensor:
    """``A`` applied to the rows of ``X (b, n)``: one ``op @ V`` per block of ``block_size``
    rows (all rows in one block when ``None``), ticking the progress bar."""
    b = X.shape[0]
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    step = max(b, 1) if block_size is None else block_size
    if 0 < b <= step:
        out = apply_rows(op, X)
    else:
        out = torch.empty_like(X)
        for i in range(0, b, step):
            out[i : i + step] = apply_rows(op, X[i : i + step])
    bar.update(b)  # type: ignore[attr-defined]
    return out


def check_gap(ratio: float, products: int, last: tuple[int, float] | None, b: int = 1) -> int:
    """Products until the next convergence check of an iterative solver, from the worst ratio
    residual / threshold now (``ratio``, at ``products``) and at the last check (``last``):
    half the products that the geometric decay between the two predicts, at most a quarter of
    the products so far, at least ``b`` (one step). See NOTE [ritz check schedule] in
    ``krylov``."""
    if last is None or not (ratio > 1.0) or not math.isfinite(ratio):
        return b
    p_prev, r_prev = last
    if not (r_prev > ratio) or products <= p_prev:
        return b
    rate = math.log(r_prev / ratio) / (products - p_prev)
    predicted = min(0.5 * math.log(ratio) / rate, products / 4)
    return max(b, b * int(predicted / b))


#: the largest operator whose k > n message suggests the dense route (the CLI's bound too)
DENSE_HINT_MAX_SIZE = 10_000


def check_k(k: int, n: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k > n:  # the alpha's words ("exceeds operator size"), the size said once
        hint = (
            "; for all eigenvalues of an operator this small, call "
            "torch.linalg.eigvalsh(op.to_dense())"
            if n <= DENSE_HINT_MAX_SIZE
            else ""
        )
        raise ValueError(f"k={k} exceeds operator size {n}: k must be between 1 and the size{hint}")
    if k < 1:
        raise ValueError(f"k must be between 1 and the operator size {n}, got k={k}")


def non_finite_error(what: str, iteration: int) -> ValueError:
    return ValueError(
        f"operator product returned non-finite values ({what}, iteration {iteration}); {_NON_FINITE_HINT}"
    )


def work_dtype(op: CurvatureOperator, precision: torch.dtype | None) -> torch.dtype:
    """dtype of bases and reductions. See NOTE [mixed precision]."""
    if precision is not None:
        if not isinstance(precision, torch.dtype) or not precision.is_floating_point:
            raise TypeError(
                f"precision must be a floating torch.dtype (e.g. torch.float64), got {precision!r}"
            )
        return precision
    if op.dtype in (torch.float32, torch.float64):
        return op.dtype
    return torch.float32


# NOTE [mixed precision]
# Products run in the operator's dtype (it is the model's: bf16/fp16 models
# give bf16/fp16 products). Everything that accumulates rounding -- the
# Krylov basis, Gram-Schmidt, norms, probe sums -- runs in the working dtype
# `precision` (default: the operator's dtype when it is fp32/fp64, else
# fp32), and small projected problems (tridiagonal / Rayleigh-Ritz matrices)
# are solved in float64 on the host. Vectors are cast to the operator's
# dtype right before a product and the result cast back right after.


def apply_rows(op: CurvatureOperator, X: torch.Tensor) -> torch.Tensor:
    """``A`` applied to each row of ``X (b, n)``, returned in ``X``'s dtype."""
    Xo = X.to(op.dtype)
    out = op.matvec(Xo[0]).unsqueeze(0) if X.shape[0] == 1 else op.matmat(Xo.T).T
    return out.to(X.dtype)


# NOTE [small operators on the host]
# Besides its product, a solver step makes about 10-25 torch calls (Gram-Schmidt, norms,
# deflation, the host sync), ~1.5-2 us each whatever the size: for a small operator they
# are most of the run (Lanczos on an 80 x 80 matrix: ~15 us of calls per step against a
# 2 us product; 0.x's ARPACK loop spent less). When the vectors live in host memory and are
# small, the solvers do the same arithmetic in numpy (~0.8 us a call, no host sync to wait
# for) on numpy views of their torch buffers (no copies); the products still go through
# `op.matvec` with torch tensors (`host_matvec`). Past HOST_ARITHMETIC_MAX_NUMEL entries
# the arithmetic dominates the calls, and torch's threading settings should apply: torch
# then runs it on the CPU too. Sharded vectors (other backends), blocks and dtypes numpy
# lacks stay with torch.
HOST_ARITHMETIC_MAX_NUMEL = 2**16


def host_arithmetic(buffer: torch.Tensor, backend: LinAlgBackend) -> bool:
    """Whether a solver whose largest vector buffer is ``buffer`` does its vector arithmetic
    in numpy. See NOTE [small operators on the host]."""
    return (
        buffer.device.type == "cpu"
        and isinstance(backend, SingleDeviceBackend)
        and buffer.dtype in (torch.float32, torch.float64)
        and buffer.numel() <= HOST_ARITHMETIC_MAX_NUMEL
    )


def host_matvec(op: CurvatureOperator, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``A x`` for a host vector ``x (n,)`` (numpy, the working dtype), in ``x``'s dtype.

    ``x`` is shared with the product's input tensor, not copied."""
    t = torch.from_numpy(x)
    out = op.matvec(t if t.dtype == op.dtype else t.to(op.dtype))
    if out.requires_grad:
        out = out.detach()
    return (out if out.dtype == t.dtype else out.to(t.dtype)).numpy()


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes a new tensor can take on a CUDA ``device`` (``memory.available_memory``);
    ``None`` elsewhere: host memory does not limit probe blocks."""
    return available_memory(device) if device.type == "cuda" else None


def rows_that_fit(
    op: CurvatureOperator, wd: torch.dtype, free: int | None, share: float = 0.5
) -> int | None:
    """How many probe rows of a block fit in ``share`` of ``free`` bytes (``None``: no limit).

    A block of ``b`` probes holds ``b`` rows three times: the probes, the
    products, and the operator's per-parameter results before they are
    copied into those. At LM sizes a row is 0.5 GB (124 M float32 entries).
    """
    if free is None:
        return None
    per_row = op.size * (wd.itemsize + 2 * op.dtype.itemsize)
    return max(1, int(share * free) // per_row)


def make_generator(seed: int | None, backend: LinAlgBackend) -> torch.Generator:
    """A local CPU generator (the global RNG is never touched).

    A sharded backend that exposes ``rank`` gets a different stream per rank
    so that the shards of one probe are independent.
    """
    seed = check_count("seed", seed, minimum=None, allow_none=True)
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed + 1_000_003 * int(getattr(backend, "rank", 0)))
    return g


# NOTE [small draws on the host]
# Random rows for an accelerator are drawn there (below) because host draws of LM-sized
# blocks cost more than the products. A small block is drawn on the host exactly as on the
# CPU and copied over, so a seed gives the same start vectors and probes on every device,
# as 0.x's start vectors (`torch.rand(n)` on the CPU, then `.cuda()`) did. Power iteration
# that a step budget stops before it converges returns a result that depends on its start
# vector (compat/mlp_power_iter.py's third pair, λ3/λ4 = 0.985, after 100 steps: 6e-5 to
# 6e-3 relative error over 8 seeds), so without this a script gave other numbers on a GPU
# than on the CPU. Up to HOST_DRAW_MAX_NUMEL entries a host draw costs at most ~0.5 ms.
HOST_DRAW_MAX_NUMEL = 2**14


def random_rows(
    b: int,
    n: int,
    gen: torch.Generator,
    *,
    device: torch.device,
    dtype: torch.dtype,
    distribution: str = "gaussian",
) -> torch.Tensor:
    """``(b, n)`` random rows.

    On the CPU they are drawn in float64 and cast. On an accelerator they
    are drawn there, in ``dtype``, from a device generator seeded by one draw
    of ``gen``: probes for an LM-sized operator are ``b × n`` numbers, and
    drawing them on the host (then copying) cost more than the products
    (Hutch++ on a 1.9 M-parameter MLP on an H100: 1.2 s, 0.1 s of products).
    Blocks of at most ``HOST_DRAW_MAX_NUMEL`` entries are drawn as on the CPU
    on every device (NOTE [small draws on the host]). Either way the same
    seed gives the same rows run to run on one device.
    """
    check_distribution(distribution)
    if device.type != "cpu" and b * n > HOST_DRAW_MAX_NUMEL:
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        dev_gen = torch.Generator(device=device).manual_seed(seed)
        if distribution == "gaussian":
            return torch.randn(b, n, generator=dev_gen, device=device, dtype=dtype)
        signs = torch.empty(b, n, device=device, dtype=dtype).bernoulli_(0.5, generator=dev_gen)
        return signs.mul_(2).sub_(1)
    if distribution == "gaussian":
        out = torch.randn(b, n, generator=gen, dtype=torch.float64)
    else:
        out = (
            torch.randint(0, 2, (b, n), generator=gen, dtype=torch.int8)
            .to(torch.float64)
            .mul_(2)
            .sub_(1)
        )
    return out.to(device=device, dtype=dtype)


def check_distribution(distribution: str) -> None:
    if distribution not in ("rademacher", "gaussian"):
        raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")


def row_dots(backend: LinAlgBackend, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``(<A_i, B_i>)_i`` for row blocks ``(b, n)``: local sums then one all-reduce."""
    return backend.all_reduce_sum((A * B).sum(dim=1))


# LAPACK / cuSOLVER index a matrix with 32-bit integers: a (b, n) block of an
# LM-sized operator (b = 33 probes, n = 124 M) is past that, and cuSOLVER's QR
# then asks for "more than 1 EB" of workspace. Such blocks take the Gram path.
HOUSEHOLDER_MAX_NUMEL = 2**31 - 1


def householder_ok(W: torch.Tensor, backend: LinAlgBackend) -> bool:
    """Whether ``W (b, n)`` can go through ``torch.linalg.qr`` (one device, 32-bit indexable)."""
    return isinstance(backend, SingleDeviceBackend) and W.numel() <= HOUSEHOLDER_MAX_NUMEL


def orthonormalize_rows(
    W: torch.Tensor, backend: LinAlgBackend, rtol: float | None = None
) -> torch.Tensor:
    """Orthonormal rows spanning the rows of ``W (b, n)``; rank-deficient directions dropped.

    Single device: Householder QR; when its diagonal shows a (near) rank
    deficiency, which QR without pivoting cannot place, an SVD decides the
    rank instead. Other backends, and blocks past 32-bit indexing
    (``HOUSEHOLDER_MAX_NUMEL``): Gram-matrix orthonormalization (eigh of the
    ``(b, b)`` Gram matrix, a reduction the backend can do), applied twice so
    the result is orthonormal to working precision.
    """
    eps = torch.finfo(W.dtype).eps
    rtol = rtol if rtol is not None else 1e3 * eps
    if householder_ok(W, backend):
        Q, R = torch.linalg.qr(W.T)
        d = R.diagonal().abs()
        if Q.shape[1] == W.shape[0] and bool(
            (d > rtol * d.max().clamp_min(torch.finfo(W.dtype).tiny)).all()
        ):
            return Q.T.contiguous()
        _, sv, Vh = torch.linalg.svd(W, full_matrices=False)
        keep = sv > rtol * sv.max().clamp_min(torch.finfo(W.dtype).tiny)
        return Vh[keep].contiguous()
    out = W
    for it in range(2):
        G = backend.inner_rows(out, out).to(torch.float64)
        evals, U = torch.linalg.eigh(G)
        cut = (rtol if it == 0 else eps) * evals.max().clamp_min(1e-300)
        keep = evals > cut
        M = U[:, keep] / evals[keep].sqrt()
        out = (M.T.to(W.dtype) @ out).contiguous()
    return out


# NOTE [progress where people work]
# A tqdm bar needs a terminal or a notebook front end to redraw in place. Jupyter's
# streams say isatty() == False, so the bar is also shown when an IPython kernel runs
# us (tqdm.auto then draws a notebook widget). Anywhere else (logs of batch jobs, CI,
# `cmd > file`), a redrawn bar would be noise, but a long run must not be silent
# either: one plain line every LOG_INTERVAL_S seconds says how far it got.
LOG_INTERVAL_S = 30.0


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    get_ipython = getattr(shell, "get_ipython", None)
    ip = get_ipython() if callable(get_ipython) else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def show_progress(progress: bool | None) -> bool:
    """``progress=None`` means: a bar on a terminal or in a Jupyter notebook."""
    if progress is not None:
        return bool(progress)
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) or _in_notebook()


class _LogLines:
    """Progress as a plain line on stderr every ``LOG_INTERVAL_S`` seconds (no redraws)."""

    def __init__(self, total: int | None, desc: str) -> None:
        self.total = total
        self.desc = desc
        self.n = 0
        self.postfix = ""
        self.start = time.monotonic()
        self.last = self.start

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= LOG_INTERVAL_S:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            print(
                f"{self.desc}: {self.n}{of} products{self.postfix}, {now - self.start:.0f} s elapsed",
                file=sys.stderr,
                flush=True,
            )

    def set_postfix(self, **values: Any) -> None:
        self.postfix = "".join(f", {k} {v}" for k, v in values.items())

    def close(self) -> None:
        pass


@contextmanager
def progress_bar(total: int | None, desc: str, progress: bool | None) -> Iterator[Any]:
    """A tqdm bar on stderr (on a terminal or in Jupyter when ``progress=None``; always with
    ``progress=True``); with ``progress=None`` elsewhere, a log line every ``LOG_INTERVAL_S``
    seconds; nothing with ``progress=False``. See NOTE [progress where people work]."""
    from tqdm.auto import tqdm

    bar: Any
    if show_progress(progress):
        if _in_notebook() and importlib.util.find_spec("ipywidgets") is None:
            # the notebook widget needs ipywidgets; the text bar redraws fine in Jupyter
            from tqdm.std import tqdm
        bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
    elif progress is None:
        bar = _LogLines(total, desc)
    else:
        bar = tqdm(total=total, desc=desc, disable=True)
    try:
        yield bar
    finally:
        bar.close()


def rounding_level(work: torch.dtype, op_dtype: torch.dtype) -> float:
    """Residual, relative to ``||A||``, that rounding alone can produce.

    Gram-Schmidt and Ritz-vector assembly in the working dtype lose a modest
    multiple of its epsilon; a product in the operator's dtype rounds its
    input and output once each (a few epsilons, which for bf16 is 1.6%).
    A pair whose residual is at this level has converged as far as the
    arithmetic allows.
    """
    return 100.0 * float(torch.finfo(work).eps) + 4.0 * float(torch.finfo(op_dtype).eps)


def probe_setup(
    op: Any,
    backend: LinAlgBackend | None,
    distribution: str,
    seed: int | None,
    precision: torch.dtype | None,
) -> tuple[CurvatureOperator, LinAlgBackend, torch.Generator, torch.dtype]:
    """What every randomized estimator starts with: the checked operator, the backend,
    the probe generator and the working dtype (``distribution`` validated)."""
    op = check_operator(op)
    backend = operator_backend(op, backend)
    check_distribution(distribution)
    return op, backend, make_generator(seed, backend), work_dtype(op, precision)


# NOTE [warm starts]
# A previous EigenResult (or a basis of its vectors) as the start of a new solve, for
# curvature tracked along training: when the parameters moved little, the previous
# eigenvectors are close to the new ones and the solve needs fewer products. Lanczos with a
# single start vector gets their sum (normalised rows, equal weights): the Krylov space from
# it contains the k directions after about k products, and only the small part outside
# them (the change of the matrix) is left to damp. A true thick-restart state from the
# previous vectors would need their k residuals to be collinear, which they are not for a
# changed matrix, so it is not used. Measured (n = 300, k = 5, five spectra, perturbation
# 1e-5 of ||A||, tol 1e-4): 11-54 products instead of 20-110 cold, about half; at a
# perturbation of 1e-3 the saving falls to 10-40%. A warm start that cannot help never
# changes the answer, only the cost: a shape that does not fit raises (it is a bug of the
# caller), rows that are zero or not finite fall back to a random start with a warning.
def warm_start_rows(v0: Any, n: int, name: str) -> torch.Tensor | None:
    """The rows ``(p, n)`` of a warm start ``v0``: an ``EigenResult`` (its eigenvectors), or a
    ``(p, n)`` / ``(n, p)`` basis. ``None`` (with a warning) when they are not usable; raises
    naming ``name`` when the shape does not fit ``n``. See NOTE [warm starts]."""
    import warnings

    from hessian_eigenthings.algorithms.result import EigenResult

    if isinstance(v0, EigenResult):
        Y = v0.eigenvectors
        if Y.dim() != 2 or Y.shape[1] != n:
            raise ValueError(
                f"{name}: the previous EigenResult has eigenvectors of shape {tuple(Y.shape)}, "
                f"expected (k, {n}) for this operator (size {n})"
            )
    elif isinstance(v0, torch.Tensor):
        if v0.dim() == 1 and v0.shape[0] == n:
            Y = v0.unsqueeze(0)
        elif v0.dim() == 2 and v0.shape[1] == n:
            Y = v0
        elif v0.dim() == 2 and v0.shape[0] == n:
            Y = v0.T
        else:
            raise ValueError(
                f"{name} must have shape ({n},), (p, {n}) or ({n}, p), got {tuple(v0.shape)}"
            )
    else:
        raise TypeError(f"{name} must be a torch.Tensor or an EigenResult, got {type(v0).__name__}")
    if Y.shape[0] == 0:
        raise ValueError(
            f"{name} has no vectors (shape {tuple(v0.shape if isinstance(v0, torch.Tensor) else Y.shape)})"
        )
    Y = Y.contiguous()
    # on the vectors' device, accumulated in float64: one small read back (a copy of the
    # whole basis to the host cost seconds for a GPT-2's five vectors); a non-finite entry
    # makes its vector's norm non-finite
    norms = torch.linalg.vector_norm(Y.detach(), dim=1, dtype=torch.float64).cpu()
    if not bool(torch.isfinite(norms).all()) or not bool((norms > 0).all()):
        warnings.warn(
            f"{name}: the warm start has zero or non-finite vectors; starting from a random "
            "vector instead (a cold start)",
            UserWarning,
            stacklevel=3,
        )
        return None
    return (Y / norms.to(device=Y.device, dtype=Y.dtype).unsqueeze(1)).contiguous()
