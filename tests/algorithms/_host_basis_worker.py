"""One rank of the sharded host-basis test (run by tests/algorithms/test_host_basis.py).

Usage: ``python _host_basis_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set. A dense symmetric float64 matrix is known to every rank; rank ``r`` holds an
uneven slice of the vector's entries, and a product gathers the input shards by an all-reduce
of zero-padded copies (exact) before multiplying by its rows. Lanczos and SLQ run with
:class:`DistributedBackend` twice, with the basis on the device and streamed from host memory
in chunks of two vectors; ``OUT_DIR/rank{r}.json`` gets, per check, the largest differences,
the products of both runs and the streamed basis' counters.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hessian_eigenthings.algorithms.basis as basis_mod
import hessian_eigenthings.algorithms.krylov as krylov_mod
from hessian_eigenthings.algorithms import lanczos, spectral_density
from hessian_eigenthings.linalg_distributed import DistributedBackend
from hessian_eigenthings.operators.base import LambdaOperator

# the package's `lanczos` attribute is the function: the module by its name
lanczos_mod = importlib.import_module("hessian_eigenthings.algorithms.lanczos")


RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
N = 150
CUTS = [0, 61, N]  # uneven shards (2 ranks)


def matrix(kind: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    bulk = np.linspace(0.1, 4.0, N - 6) if kind == "spd" else np.linspace(-3.0, 2.0, N - 6)
    eigs = np.concatenate([[10.0, 9.0, 8.0, 7.0, -6.0, -5.0], bulk])  # wanted pairs stand apart
    q, r = np.linalg.qr(rng.standard_normal((N, N)))
    q = q * np.sign(np.diag(r))
    m = (q * eigs) @ q.T
    return 0.5 * (m + m.T)


class ShardedDense(LambdaOperator):
    """This rank's entries of ``M v`` from this rank's entries of ``v``; counts products."""

    def __init__(self, m: np.ndarray) -> None:
        lo, hi = CUTS[RANK], CUTS[RANK + 1]
        self.lo, self.hi = lo, hi
        self.cols = torch.as_tensor(m[:, lo:hi].copy())  # M is symmetric: rows = columns
        self.products = 0
        super().__init__(
            lambda v: self._rows(v.unsqueeze(0))[0],
            hi - lo,
            dtype=torch.float64,
            matmat_fn=self._rows,
        )
        self.global_size = N
        self.backend = DistributedBackend()

    def _rows(self, X: torch.Tensor) -> torch.Tensor:
        self.products += X.shape[0]
        full = torch.zeros(X.shape[0], N, dtype=X.dtype)
        full[:, self.lo : self.hi] = X
        dist.all_reduce(full)
        return full @ self.cols


def recorded(fn: Callable[[], Any]) -> tuple[Any, list[Any]]:
    made: list[Any] = []

    def wrap(make: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            made.append(make(*args))
            return made[-1]

        return record

    setattr(krylov_mod, "new_basis", wrap(basis_mod.new_basis))  # noqa: B010
    setattr(lanczos_mod, "new_run_bases", wrap(basis_mod.new_run_bases))  # noqa: B010
    try:
        return fn(), made
    finally:
        setattr(krylov_mod, "new_basis", basis_mod.new_basis)  # noqa: B010
        setattr(lanczos_mod, "new_run_bases", basis_mod.new_run_bases)  # noqa: B010


def compare_lanczos(kind: str, **kw: Any) -> dict[str, Any]:
    m = matrix(kind)
    ref_op = ShardedDense(m)
    ref = lanczos(ref_op, **kw)
    op = ShardedDense(m)
    got, made = recorded(lambda: lanczos(op, basis_device="cpu", **kw))
    # the eigenvectors are this rank's shards; their signs agree across ranks through the dots
    dots = torch.as_tensor((got.eigenvectors * ref.eigenvectors).sum(1))
    dist.all_reduce(dots)
    signs = torch.sign(dots).unsqueeze(1)
    basis = made[0]
    return {
        "eigenvalues": float((got.eigenvalues - ref.eigenvalues).abs().max()),
        "eigenvectors": float((got.eigenvectors * signs - ref.eigenvectors).abs().max()),
        "products": op.products,
        "products_ref": ref_op.products,
        "streamed": bool(basis.streamed),
        "peak": int(basis.peak_device_numbers),
        "chunk": 2 * (CUTS[RANK + 1] - CUTS[RANK]),
        "values": got.eigenvalues.tolist(),
        "converged": bool(got.converged.all()),
    }


def compare_density() -> dict[str, Any]:
    m = matrix("indefinite")
    kw: dict[str, Any] = dict(num_runs=3, lanczos_steps=30, seed=1, num_grid_points=100)
    ref_op = ShardedDense(m)
    ref = spectral_density(ref_op, backend=ref_op.backend, **kw)
    op = ShardedDense(m)
    got, made = recorded(lambda: spectral_density(op, backend=op.backend, basis_device="cpu", **kw))
    rows = made[0].rows
    return {
        "eigenvalues": float(
            (got.raw_eigenvalues.nan_to_num() - ref.raw_eigenvalues.nan_to_num()).abs().max()
        ),
        "eigenvectors": float((got.raw_weights - ref.raw_weights).abs().max()),
        "products": op.products,
        "products_ref": ref_op.products,
        "streamed": bool(made[0].streamed),
        "peak": int(rows.peak_device_numbers),
        "chunk": 2 * (CUTS[RANK + 1] - CUTS[RANK]),
        "values": got.raw_eigenvalues.nan_to_num().flatten().tolist(),
    }


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "lanczos_spd": lambda: compare_lanczos("spd", k=5, seed=0, tol=1e-10, ncv=16),
    "lanczos_indefinite_block": lambda: compare_lanczos(
        "indefinite", k=5, which="LM", seed=2, tol=1e-10, ncv=20, block_size=2
    ),
    "lanczos_exact_residuals": lambda: compare_lanczos(
        "indefinite", k=3, which="LA", seed=1, tol=1e-9, residuals="exact"
    ),
    "spectral_density": compare_density,
}


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    # chunks of two vectors of this rank's shard: many panels a pass
    basis_mod.CHUNK_BYTES = 2 * (CUTS[RANK + 1] - CUTS[RANK]) * 8
    results: dict[str, Any] = {}
    for name, fn in CHECKS.items():
        try:
            t0 = time.perf_counter()
            results[name] = fn()
            results[name]["_seconds"] = time.perf_counter() - t0
        except Exception as exc:
            results[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
    with open(os.path.join(out_dir, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without the gloo teardown, which has aborted ranks on some torch versions (the
    # results are on disk, and the barrier shows every rank wrote its own)
    os._exit(0)


if __name__ == "__main__":
    main()
