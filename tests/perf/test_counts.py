"""Parity guard, part 1: the work each algorithm and operator does, counted exactly.

These counts do not depend on the machine, so they run in the default suite
and fail as soon as an abstraction adds a product, a pass over the data, a
forward or a backward. Each pinned number is derived in its comment from
what the algorithm must do; a change that moves one must say why in the
CHANGELOG and update the pin.

Algorithms run on :class:`CountingOperator` (a dense float64 matrix behind a
``LambdaOperator`` with a block function), which records single-vector and
block calls; ``num_matvecs`` counts products (a block of k counts k).
Operators run on a small float32 MLP with forward hooks and a counting
``torch.autograd.grad`` (one call = one backward pass through a graph).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hessian_eigenthings import algorithms, compat
from hessian_eigenthings.loss_fns import (
    cross_entropy_loss_of_output,
    supervised_forward,
    supervised_loss,
    supervised_per_sample_loss,
)
from hessian_eigenthings.operators import (
    EmpiricalFisherOperator,
    GGNOperator,
    HessianOperator,
)
from hessian_eigenthings.operators.base import DataCurvatureOperator
from tests.perf.problems import (
    CountingOperator,
    batches,
    count_passes,
    diagonal_spectrum,
    mlp,
)

K = 3


def _quiet(fn: Callable[[], Any]) -> Any:
    """Budget-bound runs do not converge on purpose: their ConvergenceWarning is expected."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=algorithms.ConvergenceWarning)
        return fn()


def _separated() -> CountingOperator:
    # top |λ|: 10, 8, 6.5, then -5, the rest in [-1, 1]: converges in few products
    return CountingOperator(diagonal_spectrum(200))


def _flat() -> CountingOperator:
    # an evenly spaced spectrum: no Ritz value reaches rounding level within the budgets below,
    # so tol=0 runs spend exactly their budget
    return CountingOperator(torch.linspace(0.0, 1.0, 200, dtype=torch.float64))


# --------------------------------------------------------------------------
# Algorithms: products and calls
# --------------------------------------------------------------------------


def test_lanczos_budget_is_max_iter_with_the_residuals_in_it() -> None:
    c = _flat()
    res = _quiet(
        lambda: algorithms.lanczos(
            c.op, k=K, tol=0.0, ncv=20, max_iter=50, seed=0, residuals="exact"
        )
    )
    # an explicit budget bounds every product (NOTE [explicit lanczos budget]): 50 - k single
    # products (one per step, restarts cost none) + one block of k for the exact residuals
    assert c.vector_calls == 50 - K
    assert c.block_sizes == [K]
    assert c.op.num_matvecs == res.iterations == 50


@pytest.mark.parametrize("residuals", ["estimate", "recorded"])
def test_lanczos_estimated_or_recorded_residuals_cost_no_products(residuals: str) -> None:
    c = _flat()
    _quiet(
        lambda: algorithms.lanczos(
            c.op, k=K, tol=0.0, ncv=20, max_iter=50, seed=0, residuals=residuals
        )
    )
    # "recorded" is the default since issue 25 (NOTE [recorded residuals])
    assert (c.vector_calls, c.block_calls, c.op.num_matvecs) == (50, 0, 50)


def test_lanczos_converged_count() -> None:
    c = _separated()
    res = algorithms.lanczos(c.op, k=K, tol=1e-8, seed=0)
    assert bool(res.converged.all())
    # pinned: 14 Lanczos steps bring the three top Ritz residuals below 1e-8 · |θ| (gap ratio
    # (8 - 6.5) / (6.5 + 5) ≈ 0.13 for the third, so convergence within ~15 steps of the first
    # cycle, no restart: ncv = 20); the default residuals come from those products (NOTE
    # [recorded residuals]; before issue 25 a block of 3 recomputed them: 17)
    assert c.vector_calls == 14
    assert c.block_sizes == []
    assert c.op.num_matvecs == res.iterations == 14


def test_block_lanczos_one_call_per_block_step() -> None:
    c = _flat()
    res = _quiet(
        lambda: algorithms.lanczos(
            c.op, k=K, tol=0.0, seed=0, block_size=4, ncv=40, max_iter=60, residuals="exact"
        )
    )
    # (60 - k) // 4 = 14 steps, each ONE block call of 4 (never 4 single calls), + one block of k
    assert c.vector_calls == 0
    assert c.block_sizes == [4] * 14 + [K]
    assert c.op.num_matvecs == res.iterations == 56 + K


def test_block_lanczos_converged_count() -> None:
    c = _separated()
    res = algorithms.lanczos(c.op, k=K, tol=1e-8, seed=0, block_size=4)
    assert bool(res.converged.all())
    # pinned: 10 block steps of 4 (a block Krylov space grows 4 directions per pass); the
    # residuals come from those products (NOTE [recorded residuals]; before issue 25: + a block of 3)
    assert c.block_sizes == [4] * 10
    assert c.op.num_matvecs == 40


def test_deflated_power_iteration_budget() -> None:
    c = _flat()
    res = _quiet(
        lambda: algorithms.deflated_power_iteration(c.op, k=K, tol=0.0, max_iter=15, seed=0)
    )
    # k runs of max_iter single products each, then one block of k (Rayleigh-Ritz + residuals)
    assert c.vector_calls == K * 15
    assert c.block_sizes == [K]
    assert c.op.num_matvecs == res.iterations == K * 15 + K


def test_deflated_power_iteration_converged_count() -> None:
    c = _separated()
    res = algorithms.deflated_power_iteration(c.op, k=K, tol=1e-6, max_iter=500, seed=0)
    assert bool(res.converged.all())
    # pinned: 183 power steps over the three runs (rates |8/10|, |6.5/8|, |5/6.5| per step:
    # ~55 + ~65 + ~60 steps to a relative residual of 1e-6), + one block of 3
    assert c.vector_calls == 183
    assert c.block_sizes == [K]
    assert c.op.num_matvecs == res.iterations == 186


def test_power_iteration_one_budget_and_converged() -> None:
    c = _flat()
    res = algorithms.power_iteration_one(c.op, tol=0.0, max_iter=15, seed=0)
    assert (c.vector_calls, c.block_calls, c.op.num_matvecs, res.iterations) == (15, 0, 15, 15)
    c = _separated()
    res = algorithms.power_iteration_one(c.op, tol=1e-6, max_iter=500, seed=0)
    assert res.converged
    # pinned: residual ∝ (8/10)^t; (0.8)^54 ≈ 6e-6 relative to λ = 10 -> 54 steps, one product each,
    # and the residual of the last iterate comes from its own product (no extra one)
    assert (c.vector_calls, c.block_calls, c.op.num_matvecs, res.iterations) == (54, 0, 54, 54)


@pytest.mark.parametrize(
    ("budget", "block_size", "blocks"),
    [
        (30, None, [10, 10, 10]),  # sketch S (m/3), A Q (m/3), the rest as probes in one block
        (31, 4, [10, 10, 4, 4, 3]),  # probes in blocks of 4; the sketch is one block regardless
    ],
)
def test_hutch_plus_plus_spends_exactly_its_budget(
    budget: int, block_size: int | None, blocks: list[int]
) -> None:
    c = _flat()
    algorithms.trace(c.op, num_matvecs=budget, method="hutch++", seed=0, block_size=block_size)
    assert c.vector_calls == 0  # everything through blocks
    assert c.block_sizes == blocks
    assert c.op.num_matvecs == budget


@pytest.mark.parametrize(("block_size", "blocks"), [(None, [30]), (8, [8, 8, 8, 6])])
def test_hutchinson_spends_exactly_its_budget(block_size: int | None, blocks: list[int]) -> None:
    c = _flat()
    algorithms.trace(c.op, num_matvecs=30, method="hutchinson", seed=0, block_size=block_size)
    assert (c.vector_calls, c.block_sizes, c.op.num_matvecs) == (0, blocks, 30)


@pytest.mark.parametrize(
    ("method", "block_size", "blocks"),
    [("diag++", None, [10, 10, 10]), ("hutchinson", 8, [8, 8, 8, 6])],
)
def test_diagonal_spends_exactly_its_budget(
    method: str, block_size: int | None, blocks: list[int]
) -> None:
    c = _flat()
    res = algorithms.diagonal(c.op, num_matvecs=30, method=method, seed=0, block_size=block_size)  # type: ignore[arg-type]
    assert (c.vector_calls, c.block_sizes, c.op.num_matvecs, res.num_matvecs) == (0, blocks, 30, 30)


def test_spectral_density_runs_in_lockstep() -> None:
    c = _flat()
    algorithms.spectral_density(c.op, num_runs=4, lanczos_steps=12, seed=0, num_grid_points=64)
    # runs x steps products, as ONE block of all runs per Lanczos step
    assert c.vector_calls == 0
    assert c.block_sizes == [4] * 12
    assert c.op.num_matvecs == 48


def test_spectral_density_groups_by_memory_budget() -> None:
    c = _flat()
    per_run = 12 * 200 * 8  # one reorthogonalized float64 basis of 12 steps
    algorithms.spectral_density(
        c.op, num_runs=4, lanczos_steps=12, seed=0, num_grid_points=64, memory_budget=2 * per_run
    )
    # two lockstep groups of two runs: same products, twice the calls
    assert c.block_sizes == [2] * 24
    assert c.op.num_matvecs == 48


# --------------------------------------------------------------------------
# Operators: passes per product
# --------------------------------------------------------------------------

CE = nn.CrossEntropyLoss()


def _hessian(model: nn.Module, data: list[Any], **kw: Any) -> DataCurvatureOperator:
    return _vmapped(HessianOperator(model, data, supervised_loss(CE), **kw))


def _vmapped(op: Any) -> Any:
    """Blocks through one vmapped backward, as on an accelerator (NOTE [blocks on the CPU])."""
    op._batched_ok = None
    return op


def _ggn(model: nn.Module, data: list[Any], **kw: Any) -> DataCurvatureOperator:
    return GGNOperator(model, data, supervised_forward, cross_entropy_loss_of_output(), **kw)


def _fisher(model: nn.Module, data: list[Any], **kw: Any) -> DataCurvatureOperator:
    per_sample = supervised_per_sample_loss(nn.CrossEntropyLoss(reduction="none"))
    return EmpiricalFisherOperator(model, data, per_sample, **kw)


def _products(
    op: DataCurvatureOperator, model: nn.Module, count: int, k: int | None = None
) -> list[tuple[int, int]]:
    """(model forwards, backward passes) of each of ``count`` products (blocks of k if given)."""
    g = torch.Generator().manual_seed(0)
    out = []
    with count_passes(model) as c:
        for _ in range(count):
            c.reset()
            if k is None:
                op.matvec(torch.randn(op.size, generator=g))
            else:
                op.matmat(torch.randn(op.size, k, generator=g))
            out.append((c.forwards, c.backwards))
    return out


# Hessian (reverse over reverse): per batch one forward, one backward with create_graph
# (the gradient), one backward of <g, v> (the product) -> (1, 2). With graph reuse the
# first two are kept: (0, 1). A block of k goes through the second backward batched
# (is_grads_batched): still (1, 2) per batch, never k times. On the CPU the block's
# second backward runs once per vector instead (NOTE [blocks on the CPU]).
@pytest.mark.parametrize("k", [None, 4])
def test_hessian_passes_per_product(k: int | None) -> None:
    model = mlp()
    op = _hessian(model, batches(1), graph_reuse=False)
    assert _products(op, model, 3, k) == [(1, 2)] * 3
    assert (op.num_forwards, op.num_passes) == (3, 3)
    assert op.num_matvecs == 3 * (k or 1)


def test_hessian_blocks_on_the_cpu_share_the_forward_and_loop_the_second_backward() -> None:
    model = mlp()
    op = HessianOperator(model, batches(1), supervised_loss(CE), graph_reuse=False)
    assert _products(op, model, 2, 4) == [(1, 1 + 4)] * 2
    V = torch.randn(op.size, 4, generator=torch.Generator().manual_seed(1))
    looped = op @ V
    batched = _hessian(model, batches(1), graph_reuse=False) @ V
    torch.testing.assert_close(looped, batched, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [None, 4])
def test_hessian_graph_reuse_costs_one_backward(k: int | None) -> None:
    model = mlp()
    op = _hessian(model, batches(1))  # graph_reuse="auto": one batch is kept
    assert _products(op, model, 3, k) == [(1, 2), (0, 1), (0, 1)]
    assert (op.num_forwards, op.num_passes) == (1, 1)


@pytest.mark.parametrize("k", [None, 4])
def test_hessian_one_pass_per_batch(k: int | None) -> None:
    model = mlp()
    op = _hessian(model, batches(3), graph_reuse=False)
    assert _products(op, model, 2, k) == [(3, 6)] * 2  # 3 batches x (1, 2), blocks included
    assert (op.num_forwards, op.num_passes) == (6, 6)
    model = mlp()
    op = _hessian(model, batches(3))  # 3 batches <= graph_reuse_max_batches: all kept
    assert _products(op, model, 3, k) == [(3, 6), (0, 3), (0, 3)]


def test_hessian_cycling_takes_one_batch_per_product() -> None:
    model = mlp()
    op = _hessian(model, batches(3), full_dataset=False)
    # full_dataset=False: the next batch per product; a cycled batch cannot be reused
    assert _products(op, model, 4) == [(1, 2)] * 4


def test_hessian_microbatches_cost_one_pass_each() -> None:
    model = mlp()
    op = _hessian(model, batches(1, size=32), graph_reuse=False, microbatch_size=10)
    assert _products(op, model, 2) == [(4, 8)] * 2  # chunks of 10, 10, 10, 2
    assert op.num_passes == 8


# GGN and empirical Fisher (J^T H J): per batch one forward that keeps the output's graph,
# one forward-mode pass for J v (also a model call), one backward for J^T u; the loss
# Hessian is closed form -> 2 model calls, 1 backward. With reuse the forward is kept:
# (1, 1). A block of k: J V by vmap over the forward-mode pass (one call), J^T U batched.
@pytest.mark.parametrize("make", [_ggn, _fisher], ids=["ggn", "fisher"])
@pytest.mark.parametrize("k", [None, 4])
def test_sandwich_passes_per_product(
    make: Callable[..., DataCurvatureOperator], k: int | None
) -> None:
    model = mlp()
    op = make(model, batches(1), graph_reuse=False)
    assert _products(op, model, 3, k) == [(2, 1)] * 3
    assert op.num_forwards == 3
    model = mlp()
    op = make(model, batches(1))
    assert _products(op, model, 3, k) == [(2, 1), (1, 1), (1, 1)]
    assert op.num_forwards == 1
    model = mlp()
    op = make(model, batches(3), graph_reuse=False)
    assert _products(op, model, 2, k) == [(6, 3)] * 2


# --------------------------------------------------------------------------
# The facade pays what the core pays
# --------------------------------------------------------------------------


def _facade_apply_counts(full_dataset: bool, count: int) -> list[tuple[int, int]]:
    model = mlp()
    with pytest.warns(DeprecationWarning):
        op = compat.HVPOperator(model, batches(3), CE, use_gpu=False, full_dataset=full_dataset)
    g = torch.Generator().manual_seed(0)
    out = []
    with count_passes(model) as c:
        for _ in range(count):
            c.reset()
            op.apply(torch.randn(op.size, generator=g))
            out.append((c.forwards, c.backwards))
    return out


@pytest.mark.parametrize("full_dataset", [True, False])
def test_facade_apply_costs_what_the_core_matvec_costs(full_dataset: bool) -> None:
    model = mlp()
    core = _products(_hessian(model, batches(3), full_dataset=full_dataset), model, 4)
    facade = _facade_apply_counts(full_dataset, 4)
    assert facade == core
    # and both are what the design says: all batches kept after the first product, or one
    # fresh batch per product when cycling
    assert core == ([(3, 6)] + [(0, 3)] * 3 if full_dataset else [(1, 2)] * 4)


def test_facade_operator_blocks_are_one_pass() -> None:
    model = mlp()
    with pytest.warns(DeprecationWarning):
        op = _vmapped(compat.HVPOperator(model, batches(1), CE, use_gpu=False))
    assert _products(op, model, 2, k=4) == [(1, 2), (0, 1)]
    assert op.num_matvecs == 8


def _batch_size_probes(op: DataCurvatureOperator, count: int) -> list[int]:
    """Calls of ``batching.batch_size`` by the data loop, per product (after a warm-up product)."""
    from hessian_eigenthings.operators import base

    real = base.batch_size
    calls = [0]

    def probe(batch: Any) -> int:
        calls[0] += 1
        return real(batch)

    g = torch.Generator().manual_seed(0)
    op.matvec(torch.randn(op.size, generator=g))
    out = []
    with mock.patch.object(base, "batch_size", probe):
        for _ in range(count):
            calls[0] = 0
            op.matvec(torch.randn(op.size, generator=g))
            out.append(calls[0])
    return out


@pytest.mark.parametrize("full_dataset", [True, False])
@pytest.mark.parametrize("loader", ["list", "DataLoader"])
def test_facade_data_loop_does_the_core_bookkeeping(full_dataset: bool, loader: str) -> None:
    # equal batches: the facade's operator IS the core's (size weighting = 0.x's average, no
    # microbatch path when no batch exceeds max_possible_gpu_samples): the same Python work per
    # product, not just the same passes
    data: Any = batches(3)
    if loader == "DataLoader":
        x = torch.cat([b[0] for b in data])
        y = torch.cat([b[1] for b in data])
        data = DataLoader(TensorDataset(x, y), batch_size=32)
    model = mlp()
    with pytest.warns(DeprecationWarning):
        facade = compat.HVPOperator(model, data, CE, use_gpu=False, full_dataset=full_dataset)
    core = _hessian(model, data, full_dataset=full_dataset)
    assert _batch_size_probes(facade, 3) == _batch_size_probes(core, 3)


def test_facade_short_last_batch_pays_one_probe_per_batch() -> None:
    # a short last batch: the facade keeps 0.x's per-batch average (batch_weighting="uniform"),
    # which reads each batch's size once per product; nothing else is added
    data = batches(2) + batches(1, size=5, seed=2)
    model = mlp()
    with pytest.warns(DeprecationWarning):
        facade = compat.HVPOperator(model, data, CE, use_gpu=False)
    core = _hessian(model, data)
    assert facade.batch_weighting == "uniform"
    f, c = _batch_size_probes(facade, 2), _batch_size_probes(core, 2)
    assert [a - b for a, b in zip(f, c, strict=True)] == [3, 3]
