"""Integer arguments of the core: bools and non-integers are refused with the argument's name
(issue 15, item 7)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.algorithms import (
    deflated_power_iteration,
    diagonal,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    power_iteration_one,
    spectral_density,
    trace,
)
from hessian_eigenthings.algorithms.trace import xtrace
from hessian_eigenthings.loss_fns import supervised_loss, supervised_per_sample_loss
from hessian_eigenthings.operators import EmpiricalFisherOperator, HessianOperator, LambdaOperator

SUP = supervised_loss(nn.CrossEntropyLoss())
BAD = [True, 2.5, "3"]


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,)))]


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 3)).double()


@pytest.mark.parametrize("arg", ["microbatch_size", "max_block_size", "graph_reuse_max_batches", "num_batches"])
@pytest.mark.parametrize("bad", BAD)
def test_operator_counts(arg: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"{arg} must be an int"):
        HessianOperator(model(), data(), SUP, **{arg: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD)
def test_sample_dim(bad: object) -> None:
    with pytest.raises(ValueError, match="sample_dim must be an int"):
        EmpiricalFisherOperator(model(), data(), supervised_per_sample_loss(nn.CrossEntropyLoss()), sample_dim=bad)  # type: ignore[arg-type]


def dense() -> LambdaOperator:
    m = torch.diag(torch.linspace(1.0, 2.0, 12, dtype=torch.float64))
    return LambdaOperator(lambda v: m @ v, 12, dtype=torch.float64)


@pytest.mark.parametrize("bad", BAD)
def test_algorithm_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="max_iter must be an int"):
        lanczos(dense(), k=2, max_iter=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ncv must be an int"):
        lanczos(dense(), k=2, ncv=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_iter must be an int"):
        power_iteration_one(dense(), max_iter=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_iter must be an int"):
        deflated_power_iteration(dense(), k=2, max_iter=bad)  # type: ignore[arg-type]


PROBES = [  # (estimator, its budget argument, a valid budget)
    *[(lambda op, kw, m=m: trace(op, method=m, **kw), "num_matvecs", 6) for m in ("hutch++", "xtrace", "hutchinson")],
    *[(lambda op, kw, m=m: diagonal(op, method=m, **kw), "num_matvecs", 6) for m in ("diag++", "xdiag", "hutchinson")],
    (lambda op, kw: hutchinson(op, **kw), "num_samples", 4),
    (lambda op, kw: hutch_plus_plus(op, **kw), "num_matvecs", 6),
    (lambda op, kw: xtrace(op, **kw), "num_matvecs", 6),
]


def density(op: LambdaOperator, kw: dict[str, object]) -> object:
    return spectral_density(op, **{"num_runs": 2, "lanczos_steps": 4, "num_grid_points": 50, **kw})


ESTIMATOR_CASES = [
    *PROBES,
    *[(run, "block_size", 2) for run, _, _ in PROBES],
    *[(run, "seed", 3) for run, _, _ in PROBES],
    (density, "num_runs", 2),
    (density, "lanczos_steps", 4),
    (density, "num_grid_points", 50),
    (density, "memory_budget", 2**20),
    (density, "seed", 3),
]


@pytest.mark.parametrize(("run", "arg", "good"), ESTIMATOR_CASES)
@pytest.mark.parametrize("bad", BAD)
def test_estimator_counts(run, arg: str, good: int, bad: object) -> None:  # type: ignore[no-untyped-def]
    op = dense()
    # xtrace and xdiag say more about their budget: even, at least 4
    with pytest.raises(ValueError, match=rf"{arg} must be an int|needs an even {arg} >= 4 .*, got {bad!r}$"):
        run(op, {arg: bad})
    assert op.num_matvecs == 0  # refused before any product
    run(op, {arg: good})  # the same call with an int runs


@pytest.mark.parametrize("run", [lambda op, s: lanczos(op, k=2, seed=s), lambda op, s: power_iteration_one(op, seed=s)])
@pytest.mark.parametrize("bad", BAD)
def test_eigensolver_seeds(run, bad: object) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="seed must be an int"):
        run(dense(), bad)


def test_counts_below_the_minimum_name_it() -> None:
    with pytest.raises(ValueError, match="num_matvecs must be an int >= 3, got 2"):
        trace(dense(), num_matvecs=2)
    with pytest.raises(ValueError, match="num_matvecs must be an int >= 1, got 0"):
        trace(dense(), num_matvecs=0, method="hutchinson")
    with pytest.raises(ValueError, match="xtrace needs an even num_matvecs"):
        trace(dense(), num_matvecs=7, method="xtrace")
    with pytest.raises(ValueError, match="num_grid_points must be an int >= 2, got 1"):
        spectral_density(dense(), num_grid_points=1)
    with pytest.raises(ValueError, match="block_size must be an int >= 1 or None, got 0"):
        diagonal(dense(), num_matvecs=6, block_size=0)


def test_integer_like_values_still_work() -> None:
    import numpy as np

    op = HessianOperator(model(), data(), SUP, microbatch_size=np.int64(2), num_batches=np.int64(1))
    assert op @ torch.randn(op.size, dtype=torch.float64) is not None
    res = lanczos(dense(), k=2, max_iter=np.int64(40), seed=0)
    assert res.eigenvalues.shape == (2,)
    est = trace(dense(), num_matvecs=np.int64(6), seed=np.int64(0), block_size=np.int64(2), method="hutchinson")
    assert est.samples.shape == (6,)
    density = spectral_density(dense(), num_runs=np.int64(2), lanczos_steps=np.int64(4), num_grid_points=np.int64(20))
    assert density.grid.shape == (20,)
