"""Operators with known spectra for the algorithm tests (float64 unless said otherwise).

Small cases are dense ``Q diag(λ) Qᵀ`` with a random orthogonal ``Q``; large
cases are diagonal or low-rank-plus-diagonal LambdaOperators so that a
product stays O(n).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hessian_eigenthings.operators.base import CurvatureOperator, LambdaOperator


def spectrum(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "separated":
        return np.linspace(10.0, 1.0, n)
    if kind == "clustered":  # a tight cluster at the top, then a gap
        top = min(n, 6)
        return np.concatenate([5.0 + 1e-3 * np.arange(top), rng.uniform(0.0, 1.0, n - top)])
    if kind == "powerlaw":
        return 1.0 / np.arange(1, n + 1) ** 1.5
    if kind == "indefinite":
        return np.linspace(-3.0, 2.0, n) + 0.01 * rng.standard_normal(n)
    if kind == "lowrank":
        r = max(1, n // 5)
        return np.concatenate([np.linspace(4.0, 1.0, r), np.zeros(n - r)])
    raise ValueError(kind)


KINDS = ["separated", "clustered", "powerlaw", "indefinite", "lowrank"]


def random_orthogonal(n: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed + 1000).standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def dense_matrix(eigs: np.ndarray, seed: int = 0) -> np.ndarray:
    q = random_orthogonal(len(eigs), seed)
    m = (q * eigs) @ q.T
    return 0.5 * (m + m.T)


def dense_op(m: np.ndarray, dtype: torch.dtype = torch.float64) -> LambdaOperator:
    mt = torch.as_tensor(m, dtype=dtype)
    return LambdaOperator(
        lambda v: mt @ v, m.shape[0], dtype=dtype, matmat_fn=lambda rows: rows @ mt
    )


def diag_op(d: np.ndarray, dtype: torch.dtype = torch.float64) -> LambdaOperator:
    dt = torch.as_tensor(d, dtype=dtype)
    return LambdaOperator(lambda v: dt * v, len(d), dtype=dtype, matmat_fn=lambda rows: rows * dt)


def lowrank_plus_diag(
    n: int, r: int, seed: int = 0
) -> tuple[LambdaOperator, Callable[[np.ndarray], np.ndarray]]:
    """``A = U diag(s) Uᵀ + diag(d)`` of size n; returns the operator and a numpy matvec."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((n, r)))
    s = np.linspace(20.0, 5.0, r)
    d = rng.uniform(0.0, 1.0, n)
    ut, st, dt = (torch.as_tensor(x) for x in (u, s, d))

    def rows_fn(rows: torch.Tensor) -> torch.Tensor:
        return ((rows @ ut) * st) @ ut.T + rows * dt

    op = LambdaOperator(
        lambda v: rows_fn(v.unsqueeze(0))[0], n, dtype=torch.float64, matmat_fn=rows_fn
    )

    def np_mv(x: np.ndarray) -> np.ndarray:
        x = x.reshape(n, -1)
        return (u @ (s[:, None] * (u.T @ x)) + d[:, None] * x).reshape(
            x.shape if x.shape[1] > 1 else (n,)
        )

    return op, np_mv


class CountingOp(CurvatureOperator):
    """A user's own CurvatureOperator subclass: dense, counts block passes."""

    def __init__(self, m: torch.Tensor) -> None:
        self.m = m
        self._size = m.shape[0]
        self._device = m.device
        self._dtype = m.dtype
        self.passes = 0

    def _matmat_rows(self, rows: torch.Tensor) -> torch.Tensor:
        self.passes += 1
        return rows @ self.m


class TorchOnlyBackend:
    """A ``LinAlgBackend`` that is not the single-device one, as a sharded backend is not:
    the solvers then do all their vector arithmetic in torch (never in numpy on the host)."""

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.dot(a.reshape(-1), b.reshape(-1))

    def norm(self, a: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(a)

    def inner_rows(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return A @ B.T

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


def sa_problem_80() -> tuple[torch.Tensor, LambdaOperator]:
    """compat/lanczos_smallest.py's matrix (float32, eigenvalues linspace(-2, 5, 80)) as a
    1.0 operator."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    a = q @ torch.diag(torch.linspace(-2.0, 5.0, 80)) @ q.T
    return a, LambdaOperator(lambda v: a @ v, 80, dtype=torch.float32)
