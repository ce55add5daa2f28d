"""Integer arguments of the core: bools and non-integers are refused with the argument's name
(issue 15, item 7)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hessian_eigenthings.algorithms import deflated_power_iteration, lanczos, power_iteration_one
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


def test_integer_like_values_still_work() -> None:
    import numpy as np

    op = HessianOperator(model(), data(), SUP, microbatch_size=np.int64(2), num_batches=np.int64(1))
    assert op @ torch.randn(op.size, dtype=torch.float64) is not None
    res = lanczos(dense(), k=2, max_iter=np.int64(40), seed=0)
    assert res.eigenvalues.shape == (2,)
