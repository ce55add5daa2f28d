"""Top-k by block products: which block eigensolver, and when a block beats single products.

    python -m benchmarks.bench_block_solvers --out bench_out/block_solvers
    python -m benchmarks.bench_block_solvers --quick --out /tmp/blk      # seconds

Task: top-10 eigenpairs at tol=1e-4 (``||Av − θv|| <= tol·|θ|`` for every
pair, checked with true residuals after the run) of symmetric PSD
operators on the CPU, float64, one thread. Solvers:

- ``lanczos``: thick-restart Lanczos, one vector per product (``block_size=1``);
- ``lanczos-b4`` / ``lanczos-b8``: block Lanczos, ``block_size`` 4 / 8;
- ``lobpcg``: ``torch.lobpcg`` (method "ortho", block of k, largest=True),
  given the operator through a wrapper tensor whose only operation is
  ``A @ X`` (``torch.lobpcg`` accepts tensors, not callables);
- ``subspace-20``: randomized subspace iteration written here: a random
  block of p = 2k vectors, then repeat {one block product, Rayleigh-Ritz,
  next block = orth(A·Ritz vectors)} until the k wanted pairs converge.

Spectra (from the test suite): ``powerlaw`` ``1/i^1.5``; ``separated``
20 values in [10, 5] over a uniform [0, 1] bulk; ``clustered`` 6 values
5.000-5.005 over a uniform [0, 1] bulk, so pairs 7-10 sit at the bulk's
edge. Cost models:

- ``diag-orth``: ``A = H D H`` with a Householder reflection ``H`` (dense
  eigenvectors); a block of b costs b times a product (elementwise, memory
  bound): no block advantage;
- ``pass-bound``: ``diag-orth`` plus a sleep of --pass-ms for a single
  product and 1.5 × --pass-ms for a block of any width: a model of a
  model-Hessian pass on a GPU, where a block rides on one forward/backward;
- ``gemm``: ``U diag(s) Uᵀ + diag(d)`` with dense ``U (n, 64)`` (the test
  suite's low-rank-plus-diagonal spectrum, reference from Lanczos at tol
  1e-10): a block product is one GEMM, cheaper per vector than singles.

Reported per run: products, passes (block calls), wall time (median of
--repeats after a warm-up), converged pairs (by the true residuals), max
relative eigenvalue error. Writes ``block_solvers.json`` / ``.md`` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hessian_eigenthings.algorithms import ConvergenceWarning, lanczos  # noqa: E402
from hessian_eigenthings.operators.base import LambdaOperator  # noqa: E402

K, TOL, MAX_PRODUCTS = 10, 1e-4, 4000
PASS_MS = 5.0
SPECTRA = ("powerlaw", "separated", "clustered")
MODELS = ("diag-orth", "pass-bound", "gemm")
SOLVERS = ("lanczos", "lanczos-b4", "lanczos-b8", "lobpcg", "subspace-20")


class Problem:
    """An operator, its raw block product (uncounted, for checks) and a pass counter."""

    def __init__(
        self, rows: Callable[[torch.Tensor], torch.Tensor], n: int, top: np.ndarray, sleep_ms: float
    ) -> None:
        self.raw = rows
        self.top = top  # (K,) reference eigenvalues, descending
        self.passes = 0

        def counted(x: torch.Tensor) -> torch.Tensor:
            self.passes += 1
            if sleep_ms:
                time.sleep((sleep_ms if x.shape[0] == 1 else 1.5 * sleep_ms) / 1000.0)
            return rows(x)

        self.op = LambdaOperator(
            lambda v: counted(v[None])[0], n, dtype=torch.float64, matmat_fn=counted
        )


def spectrum(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "powerlaw":
        return 1.0 / np.arange(1, n + 1) ** 1.5
    if kind == "separated":
        return np.concatenate([np.linspace(10.0, 5.0, 20), rng.uniform(0.0, 1.0, n - 20)])
    if kind == "clustered":
        return np.concatenate([5.0 + 1e-3 * np.arange(6), rng.uniform(0.0, 1.0, n - 6)])
    raise ValueError(kind)


def make_problem(spec: str, model: str, n: int, pass_ms: float) -> Problem:
    gen = torch.Generator().manual_seed(0)
    if model == "gemm":
        r = 64
        u = torch.linalg.qr(torch.randn(n, r, generator=gen, dtype=torch.float64))[0]
        s = torch.linspace(20.0, 5.0, r, dtype=torch.float64)
        d = torch.rand(n, generator=gen, dtype=torch.float64)

        def gemm_rows(x: torch.Tensor) -> torch.Tensor:
            return ((x @ u) * s) @ u.T + x * d

        ref_op = LambdaOperator(
            lambda v: gemm_rows(v[None])[0], n, dtype=torch.float64, matmat_fn=gemm_rows
        )
        top = lanczos(ref_op, k=K, tol=1e-10, ncv=60, seed=123, residuals="estimate")
        return Problem(gemm_rows, n, np.sort(top.eigenvalues.numpy())[::-1].copy(), 0.0)
    lam = spectrum(spec, n)
    dt = torch.as_tensor(lam)
    h = torch.randn(n, generator=gen, dtype=torch.float64)
    h /= torch.linalg.vector_norm(h)

    def reflect(x: torch.Tensor) -> torch.Tensor:  # rows x ↦ x (I − 2hhᵀ)
        return x - 2.0 * (x @ h).unsqueeze(1) * h

    def rows(x: torch.Tensor) -> torch.Tensor:
        return reflect(reflect(x) * dt)

    top = np.sort(lam)[::-1][:K].copy()
    return Problem(rows, n, top, pass_ms if model == "pass-bound" else 0.0)


# -- solvers: each returns (eigenvalues (K,) descending, eigenvectors (K, n)) -----


def run_lanczos(p: Problem, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    res = lanczos(p.op, k=K, tol=TOL, which="LA", block_size=b, seed=0, max_iter=MAX_PRODUCTS)
    return res.eigenvalues, res.eigenvectors


class OpTensor(torch.Tensor):
    """A wrapper tensor standing for the operator: ``torch.lobpcg`` only needs ``A @ X``."""

    op: LambdaOperator

    @staticmethod
    def __new__(cls, op: LambdaOperator) -> OpTensor:
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, (op.size, op.size), dtype=op.dtype, device=op.device
        )
        t.op = op
        return t  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> torch.Tensor:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default):
            A, X = args
            if isinstance(A, OpTensor) and not isinstance(X, OpTensor):
                return A.op.matmat(X)
        raise NotImplementedError(f"OpTensor supports only A @ X, got {func}")


def run_lobpcg(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    X = torch.randn(p.op.size, K, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    E, V = torch.lobpcg(
        OpTensor(p.op), k=K, X=X, tol=TOL, largest=True, niter=MAX_PRODUCTS // (3 * K)
    )
    return E, V.T


def run_subspace(p: Problem, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomized subspace iteration with Rayleigh-Ritz: one block product per iteration."""
    op = p.op
    V = torch.randn(width, op.size, generator=torch.Generator().manual_seed(0), dtype=op.dtype)
    V = torch.linalg.qr(V.T)[0].T
    products = 0
    while True:
        W = op.matmat(V.T).T
        products += width
        H = V @ W.T
        theta, S = torch.linalg.eigh(0.5 * (H + H.T))
        theta, S = theta.flip(0), S.flip(1)  # descending: the largest (PSD: = largest |θ|)
        X, AX = S.T @ V, S.T @ W
        res = torch.linalg.vector_norm(AX[:K] - theta[:K, None] * X[:K], dim=1)
        if bool((res <= TOL * theta[:K].abs()).all()) or products + width > MAX_PRODUCTS:
            return theta[:K], X[:K]
        V = torch.linalg.qr(AX.T)[0].T  # span(A V), rotated to the Ritz basis: no extra product


SOLVER_FNS: dict[str, Callable[[Problem], tuple[torch.Tensor, torch.Tensor]]] = {
    "lanczos": lambda p: run_lanczos(p, 1),
    "lanczos-b4": lambda p: run_lanczos(p, 4),
    "lanczos-b8": lambda p: run_lanczos(p, 8),
    "lobpcg": run_lobpcg,
    "subspace-20": lambda p: run_subspace(p, 2 * K),
}


def measure(p: Problem, solver: str, repeats: int) -> dict[str, Any]:
    """Runs after a per-solver warm-up (``main``); a run over 5 s is not repeated."""
    fn = SOLVER_FNS[solver]
    times, products, passes = [], [], []
    vals = vecs = torch.zeros(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for _ in range(repeats):
            p.op.num_matvecs = 0
            p.passes = 0
            t0 = time.perf_counter()
            vals, vecs = fn(p)
            times.append(time.perf_counter() - t0)
            products.append(p.op.num_matvecs)
            passes.append(p.passes)
            if times[-1] > 5.0:
                break
    vals64 = vals.to(torch.float64)
    order = torch.argsort(vals64, descending=True)
    vals64, vecs = vals64[order], vecs[order].to(torch.float64)
    vecs = vecs / torch.linalg.vector_norm(vecs, dim=1, keepdim=True)
    res = torch.linalg.vector_norm(p.raw(vecs) - vals64[:, None] * vecs, dim=1)
    rel_res = res / vals64.abs()
    err = np.abs(vals64.numpy() - p.top) / np.abs(p.top)
    return {
        "solver": solver,
        "products": int(statistics.median(products)),
        "passes": int(statistics.median(passes)),
        "wall_s": statistics.median(times),
        "converged": int((rel_res <= TOL * 1.01).sum()),
        "max_rel_residual": float(rel_res.max()),
        "max_rel_err": float(err.max()),
    }


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"device: {meta['device']}, torch {meta['torch']}, float64, {meta['threads']} thread(s), "
        f"repeats {meta['repeats']} (medians; runs over 5 s once), pass-bound sleep {meta['pass_ms']} ms "
        "(single) / 1.5x (block)",
        "",
        "| model | spectrum | n | solver | products | passes | wall (s) | converged | max rel err |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['spectrum']} | {r['n']:,} | {r['solver']} | {r['products']} | "
            f"{r['passes']} | {r['wall_s']:.3f} | {r['converged']}/{K} | {r['max_rel_err']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[20_000, 100_000])
    ap.add_argument("--spectra", nargs="+", default=list(SPECTRA), choices=SPECTRA)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=SOLVERS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pass-ms", type=float, default=PASS_MS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="n=5000, one repeat")
    ap.add_argument("--out", type=Path, default=Path("bench_out/block_solvers"))
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.repeats = [5000], 1
    torch.set_num_threads(args.threads)
    # the host-side small eigenproblems run in numpy: on a shared machine its
    # default BLAS threads fight over the cores (13 ms instead of 1.5 ms for an
    # 88 x 88 eigh under load), so pin them too
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(ImportError):
            from threadpoolctl import threadpool_limits

            stack.enter_context(threadpool_limits(args.threads))
        run(args)


def run(args: argparse.Namespace) -> None:
    meta = {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "threads": args.threads,
        "repeats": args.repeats,
        "pass_ms": args.pass_ms,
    }
    warm = make_problem("powerlaw", "diag-orth", 2000, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for solver in args.solvers:  # first calls pay one-off costs (lobpcg: seconds)
            SOLVER_FNS[solver](warm)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for spec in args.spectra if model != "gemm" else ["lowrank"]:
            for n in args.n:
                p = make_problem(spec, model, n, args.pass_ms)
                for solver in args.solvers:
                    row = {
                        "model": model,
                        "spectrum": spec,
                        "n": n,
                        **measure(p, solver, args.repeats),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "block_solvers.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows, meta)
    (args.out / "block_solvers.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
