"""Sharded operators (``global_size`` > ``size``): caps use the global length, vectors stay local.

Two "ranks" run as threads in one process; their backend sums reductions
through a barrier (a stand-in for an all-reduce), and the operator is a
dense symmetric matrix whose rows are split across the ranks (each product
all-gathers the input shards), like an FSDP operator's local view.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import (
    ConvergenceWarning,
    deflated_power_iteration,
    diagonal,
    lanczos,
    spectral_density,
    trace,
)
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix, spectrum


class _Group:
    """Collectives between threads: every rank contributes, all read the same combination."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.clone()
        self.barrier.wait()
        parts = [s for s in self.slots if s is not None]
        self.barrier.wait()  # nobody writes the next round before all have read this one
        return parts

    def all_reduce(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(rank, t)
        total = parts[0]
        for p in parts[1:]:
            total = total + p  # same order on every rank: identical results
        return total

    def all_gather_cols(self, rank: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(rank, rows), dim=1)


class _ShardBackend:
    def __init__(self, group: _Group, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.rank, t)

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(torch.dot(a.reshape(-1), b.reshape(-1)))

    def norm(self, a: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(torch.linalg.vector_norm(a).square()).sqrt()

    def inner_rows(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_sum(A @ B.T)


class _ShardedDense(LambdaOperator):
    """Rank ``rank``'s rows of a dense symmetric ``M``; exposes ``global_size``."""

    def __init__(self, m: np.ndarray, cuts: list[int], rank: int, group: _Group) -> None:
        mt = torch.as_tensor(m)
        cols = mt[:, cuts[rank] : cuts[rank + 1]]

        def rows_fn(rows: torch.Tensor) -> torch.Tensor:
            return group.all_gather_cols(rank, rows) @ cols

        super().__init__(
            lambda v: rows_fn(v.unsqueeze(0))[0],
            cuts[rank + 1] - cuts[rank],
            dtype=torch.float64,
            matmat_fn=rows_fn,
        )
        self.global_size = m.shape[0]


def _on_ranks(
    m: np.ndarray, shards: list[int], fn: Callable[[_ShardedDense, _ShardBackend], Any]
) -> list[Any]:
    cuts = [0, *np.cumsum(shards).tolist()]
    group = _Group(len(shards))
    out: list[Any] = [None] * len(shards)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(_ShardedDense(m, cuts, rank, group), _ShardBackend(group, rank))
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_lanczos_k_above_the_local_size_is_exact_on_the_whole_space() -> None:
    eigs = spectrum("indefinite", 12, seed=3)
    m = dense_matrix(eigs, seed=3)
    # k=10 exceeds both shards (7 and 5); ncv is capped by 12, the whole space: exact
    res = _on_ranks(m, [7, 5], lambda op, be: lanczos(op, k=10, seed=0, backend=be))
    want = eigs[np.argsort(-np.abs(eigs))][:10]
    for r in res:
        np.testing.assert_allclose(r.eigenvalues.numpy(), want, rtol=1e-10, atol=1e-12)
        assert bool(r.converged.all())
    assert torch.equal(res[0].eigenvalues, res[1].eigenvalues)
    vecs = torch.cat([res[0].eigenvectors, res[1].eigenvectors], dim=1).numpy()
    resid = m @ vecs.T - vecs.T * res[0].eigenvalues.numpy()
    assert np.abs(resid).max() < 1e-9


def test_lanczos_restarts_and_block_on_shards() -> None:
    eigs = spectrum("separated", 60)
    m = dense_matrix(eigs, seed=1)
    for b in (1, 2):
        res = _on_ranks(
            m, [25, 35], lambda op, be, b=b: lanczos(op, k=16, seed=1, backend=be, block_size=b)
        )
        np.testing.assert_allclose(res[0].eigenvalues.numpy(), eigs[:16], rtol=1e-6)
        assert res[0].eigenvectors.shape == (16, 25) and res[1].eigenvectors.shape == (16, 35)


def test_krylov_depth_and_k_capped_by_the_global_size() -> None:
    eigs = spectrum("powerlaw", 40)
    m = dense_matrix(eigs, seed=2)
    dens = _on_ranks(
        m,
        [15, 25],
        lambda op, be: spectral_density(
            op, num_runs=2, lanczos_steps=30, num_grid_points=50, seed=0, backend=be
        ),
    )
    # 30 steps per run, more than the 15 local entries of rank 0
    assert dens[0].raw_eigenvalues.shape == (2, 30)
    assert torch.equal(dens[0].raw_eigenvalues, dens[1].raw_eigenvalues)
    with pytest.warns(ConvergenceWarning):  # 5 products per pair: k is what is tested
        pw = _on_ranks(
            m,
            [15, 25],
            lambda op, be: deflated_power_iteration(op, k=16, max_iter=5, seed=0, backend=be),
        )
    assert pw[0].eigenvalues.shape == (16,)


@pytest.mark.parametrize("method", ["hutch++", "xtrace"])
def test_trace_sketch_spanning_the_global_space_is_exact(method: str) -> None:
    eigs = spectrum("indefinite", 12, seed=5)
    m = dense_matrix(eigs, seed=5)
    res = _on_ranks(
        m,
        [5, 7],
        lambda op, be: trace(op, num_matvecs=40, method=method, seed=0, backend=be),  # type: ignore[arg-type]
    )
    for r in res:
        assert r.estimate == pytest.approx(eigs.sum(), abs=1e-10)
    d = _on_ranks(m, [5, 7], lambda op, be: diagonal(op, num_matvecs=45, seed=0, backend=be))
    np.testing.assert_allclose(
        torch.cat([d[0].estimate, d[1].estimate]).numpy(), np.diag(m), atol=1e-10
    )
