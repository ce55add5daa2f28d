"""Parity guard, part 2: no full-length temporaries on the hot path (DESIGN.md §4).

Counts the CPU allocations of at least one full-length vector (``n ·
itemsize`` bytes, ``n`` = number of parameters) made during one product,
with ``torch.profiler`` (``profile_memory=True`` records every allocation of
the CPU allocator as a ``[memory]`` event; see ``problems.cpu_allocations``).
The model is chosen so that nothing else reaches that size: its largest
parameter (64 x 64 = 4096) and its activations (32 x 64 = 2048) are well
below ``n = 6154``. A ``torch.cat`` of per-parameter tensors, a per-batch
result buffer or a copy of the input vector each add one such allocation and
fail these tests.

What the design permits, and why each allowed allocation is there:

- a product ``H v``: ONE, the flat output buffer (``ParamLayout.empty``),
  into whose per-parameter views the results are copied; batches and
  microbatches accumulate into it in place;
- a block ``H V`` of k vectors: ONE of ``k · n``, the ``(k, n)`` output buffer;
- the facade's ``HVPOperator.apply``: the same ONE (its argument is viewed,
  not copied, when it already has the operator's dtype and device);
- one Lanczos step (steady state, no restart): no allocation of two vectors
  or more (the ``(ncv + b, n)`` basis is allocated once up front), and at most
  seven single vectors: the product's output buffer, the projection ``Hᵀ B``
  and the subtraction ``W − Hᵀ B`` of each of the two classical Gram-Schmidt
  passes (4), ``W ⊙ W`` for the norm, and the normalized ``W / β``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from hessian_eigenthings import algorithms, compat
from hessian_eigenthings.loss_fns import supervised_loss
from hessian_eigenthings.operators import HessianOperator
from tests.perf.problems import at_least, batches, cpu_allocations, mlp, num_params

CE = nn.CrossEntropyLoss()
ITEM = 4  # float32


def _op(nb: int = 1, **kw: Any) -> tuple[HessianOperator, int]:
    model = mlp()
    n = num_params(model)
    assert n == 6154
    return HessianOperator(model, batches(nb), supervised_loss(CE), **kw), n


def _vec(n: int, k: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=g) if k is None else torch.randn(k, n, generator=g)


def test_profiler_sees_allocations() -> None:
    # the counting method itself: an explicit full-length allocation is seen with its size
    sizes = cpu_allocations(lambda: torch.empty(6154))
    assert at_least(sizes, 6154 * ITEM) == [6154 * ITEM]


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("nb", [1, 3])
def test_hessian_product_allocates_one_output_buffer(reuse: bool, nb: int) -> None:
    op, n = _op(nb, graph_reuse=reuse)
    v = _vec(n)
    op.matvec(v)  # warm-up: the first product builds the kept graphs when reuse is on
    sizes = cpu_allocations(lambda: op.matvec(v))
    assert at_least(sizes, n * ITEM) == [n * ITEM], sorted(sizes)[-5:]


def test_microbatched_product_accumulates_in_place() -> None:
    op, n = _op(1, graph_reuse=False, microbatch_size=10)  # 4 chunks
    v = _vec(n)
    op.matvec(v)
    sizes = cpu_allocations(lambda: op.matvec(v))
    assert at_least(sizes, n * ITEM) == [n * ITEM]


@pytest.mark.parametrize("reuse", [False, True])
def test_block_product_allocates_one_block_buffer(reuse: bool) -> None:
    k = 4
    op, n = _op(1, graph_reuse=reuse)
    X = _vec(n, k)  # rows, as the algorithms hold blocks: op.matmat(X.T) costs no input copy
    op.matmat(X.T)
    sizes = cpu_allocations(lambda: op.matmat(X.T))
    assert at_least(sizes, k * n * ITEM) == [k * n * ITEM]


def test_facade_apply_allocates_what_the_core_allocates() -> None:
    model = mlp()
    with pytest.warns(DeprecationWarning):
        op = compat.HVPOperator(model, batches(3), CE, use_gpu=False)
    n = op.size
    v = _vec(n)
    op.apply(v)
    facade = at_least(cpu_allocations(lambda: op.apply(v)), n * ITEM)
    core_op, _ = _op(3)
    core_op.matvec(v)
    core = at_least(cpu_allocations(lambda: core_op.matvec(v)), n * ITEM)
    assert facade == core == [n * ITEM]


def _lanczos_allocations(op: HessianOperator, steps: int) -> Counter[int]:
    """Full-length allocations of a Lanczos run of exactly ``steps`` products, by size in vectors."""
    n = op.size
    res: list[Any] = []

    def run() -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=algorithms.ConvergenceWarning)
            res.append(
                algorithms.lanczos(
                    op, k=3, tol=0.0, ncv=40, max_iter=steps, seed=0, residuals="estimate"
                )
            )

    sizes = cpu_allocations(run)
    assert res[0].iterations == steps  # no early stop: the two runs differ by whole steps only
    return Counter(s // (n * ITEM) for s in at_least(sizes, n * ITEM))


def test_lanczos_step_allocates_no_basis_sized_temporary() -> None:
    # graph reuse: the realistic setting for an eigensolver on one batch. The engine is fixed:
    # under "auto" a run whose timed product is slow (a cycle collection in it) may be judged
    # long enough for a trial, whose scratch rows then count as the steps' allocations
    op, n = _op(1, engine="autograd")
    op.matvec(_vec(n))
    short, long = _lanczos_allocations(op, 10), _lanczos_allocations(op, 20)
    per_step = {size: (long[size] - short[size]) / 10 for size in long | short}
    # one-off allocations (the (ncv + 1, n) basis, QR workspace, the Ritz vectors) cancel;
    # what is left is per step: single vectors only (see the module docstring for the seven)
    larger = {size: count for size, count in per_step.items() if size >= 2 and count}
    assert not larger, f"per-step allocations of >= 2 full-length vectors: {larger}"
    assert per_step.get(1, 0) <= 7, per_step  # measured: exactly 7 with torch 2.13
    # the basis is allocated once, whole, not grown or copied per step
    assert long[41] == short[41] == 1
