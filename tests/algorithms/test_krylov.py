"""The plan and the run state behind ``lanczos``: a plan fixes the budget before any product,
a state driven by hand is the solver, and a state round-trips through a checkpoint."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import lanczos
from hessian_eigenthings.algorithms.krylov import KrylovState, LanczosPlan
from hessian_eigenthings.linalg import SingleDeviceBackend
from tests.algorithms.spectra import dense_matrix, dense_op, diag_op, spectrum

N = 120


def _plan(op: object, **kw: object) -> LanczosPlan:
    args: dict[str, object] = dict(
        k=4, max_iter=None, tol=1e-8, reorthogonalize=None, which="LM", ncv=None,
        block_size=1, residuals="recorded", precision=None,
    )  # fmt: skip
    return LanczosPlan.for_call(op, **{**args, **kw})  # type: ignore[arg-type]


def test_plan_defaults_and_explicit_budget() -> None:
    op = dense_op(dense_matrix(spectrum("separated", N, seed=0), seed=1))
    plan = _plan(op)
    assert (plan.ncv, plan.block, plan.max_iter, plan.iteration_budget) == (20, 1, 1000, 1000)
    assert plan.residuals == "recorded" and plan.full and not plan.explicit_budget
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.ncv = 30  # type: ignore[misc]
    # NOTE [explicit lanczos budget]: the k products of an exact check come out of max_iter,
    # unless that would stop the iteration short; a budget covering the space spans it
    exact = _plan(op, max_iter=50, residuals="exact")
    assert exact.iteration_budget == 46 and exact.residuals == "exact"
    short = _plan(op, max_iter=6, residuals="exact")
    assert short.iteration_budget == 6 and short.residuals == "estimate"
    whole = _plan(op, max_iter=N)
    assert whole.ncv == N and whole.iteration_budget == N
    assert _plan(op, reorthogonalize=False).residuals == "exact"  # partial projections
    # a block falls back to b = 1 when the whole space fits in the basis
    assert _plan(op, block_size=4, ncv=N).block == 1 and _plan(op, block_size=4).block == 4
    assert _plan(op, block_size=4).ncv == 40
    with pytest.raises(ValueError, match="max_iter=3 products cannot give k=4"):
        _plan(op, max_iter=3)
    with pytest.raises(ValueError, match="ncv=4 must be at least k"):
        _plan(op, ncv=4)


def _drive(run: KrylovState, stop_after: int | None = None) -> bool:
    """The loop of ``lanczos`` without its progress bar and files; True when it finished."""
    while True:
        run.step()
        if run.check_due() and run.check():
            return True
        if run.last_step:
            return True
        run.advance()
        if stop_after is not None and run.products >= stop_after:
            return False


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("large", [False, True], ids=["host-steps", "torch-steps"])
def test_state_driven_by_hand_is_lanczos(b: int, large: bool) -> None:
    op = (
        diag_op(np.concatenate([[9.0, 8.5, 8.0], np.linspace(0.0, 7.0, 5000)]))
        if large
        else dense_op(dense_matrix(spectrum("indefinite", N, seed=0), seed=1))
    )
    gen = torch.Generator().manual_seed(0)
    start = torch.linalg.qr(torch.randn(op.size, b, generator=gen, dtype=torch.float64))[0].T
    start = start.contiguous()
    ref = lanczos(op, k=3, tol=1e-8, block_size=b, v0=start if b > 1 else start[0])
    plan = _plan(op, k=3, block_size=b)
    run = KrylovState(plan, op, SingleDeviceBackend(), torch.Generator(), start)
    assert (run.Vn is not None) == (not large and b == 1)  # NOTE [small operators on the host]
    assert _drive(run)
    res = run.result()
    # the same iteration from the same start (lanczos orthonormalizes it once more: rounding)
    assert res.iterations == ref.iterations and bool(res.converged.all())
    torch.testing.assert_close(res.eigenvalues, ref.eigenvalues, rtol=1e-12, atol=1e-12)
    signs = torch.sign((res.eigenvectors * ref.eigenvectors).sum(1, keepdim=True))
    torch.testing.assert_close(res.eigenvectors * signs, ref.eigenvectors, rtol=0, atol=1e-7)


def test_state_round_trips_through_a_checkpoint() -> None:
    op = dense_op(dense_matrix(spectrum("clustered", N, seed=0), seed=2))
    plan = _plan(op, ncv=12, tol=1e-10)
    backend = SingleDeviceBackend()

    def fresh() -> tuple[KrylovState, torch.Generator]:
        gen = torch.Generator().manual_seed(0)
        start = torch.randn(1, N, generator=gen, dtype=torch.float64)
        return KrylovState(plan, op, backend, gen, start / start.norm()), gen

    whole, _ = fresh()
    assert _drive(whole)
    first, gen = fresh()
    assert not _drive(first, stop_after=17)  # past a thick restart, inside a cycle
    state, gen_state = first.to_checkpoint(), gen.get_state()
    assert state["V"].shape == (first.j + 1, N) and state["products"] == first.products
    gen2 = torch.Generator()
    gen2.set_state(gen_state)
    resumed = KrylovState.from_checkpoint(state, plan, op, backend, gen2, path=None)  # type: ignore[arg-type]
    assert (resumed.j, resumed.restart_l, resumed.products) == (
        first.j,
        first.restart_l,
        first.products,
    )
    assert _drive(resumed)
    a, b = resumed.result(), whole.result()
    assert a.iterations == b.iterations
    assert torch.equal(a.eigenvalues, b.eigenvalues) and torch.equal(a.eigenvectors, b.eigenvectors)
    with pytest.raises(ValueError, match="not a complete lanczos state"):
        KrylovState.from_checkpoint(
            {**state, "V": state["V"][:-1]}, plan, op, backend, gen2, path=None
        )  # type: ignore[arg-type]
