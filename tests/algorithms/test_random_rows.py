"""Start vectors and probes: the same seed gives the same numbers on every device for small
blocks (NOTE [small draws on the host]). Without a GPU, the "meta" device stands in for one:
it takes the accelerator branch, and a generator's state shows what was drawn from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import ConvergenceWarning, _common, deflated_power_iteration
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import dense_matrix


@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
@pytest.mark.parametrize(("b", "n"), [(1, 134), (1, 1096), (4, 4096)])
def test_small_blocks_are_drawn_as_on_the_cpu(b: int, n: int, distribution: str) -> None:
    assert b * n <= _common.HOST_DRAW_MAX_NUMEL
    cpu_gen = torch.Generator().manual_seed(5)
    cpu = _common.random_rows(
        b, n, cpu_gen, device=torch.device("cpu"), dtype=torch.float32, distribution=distribution
    )
    acc_gen = torch.Generator().manual_seed(5)
    acc = _common.random_rows(
        b, n, acc_gen, device=torch.device("meta"), dtype=torch.float32, distribution=distribution
    )
    assert acc.device.type == "meta" and acc.shape == (b, n) and acc.dtype == torch.float32
    # the same draws from the same generator state: the same numbers, only copied elsewhere
    assert torch.equal(acc_gen.get_state(), cpu_gen.get_state())
    # and the CPU numbers are those of a float64 draw, as before
    ref = torch.randn(b, n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    if distribution == "gaussian":
        assert torch.equal(cpu, ref.float())


def test_large_blocks_are_drawn_on_the_accelerator() -> None:
    """Past the limit the accelerator branch seeds a device generator (which "meta" lacks)."""
    n = _common.HOST_DRAW_MAX_NUMEL + 1
    # torch >= 2.5: "... is not an accelerator"; torch 2.4: "Device type META is not supported"
    with pytest.raises(RuntimeError, match=r"not an accelerator|META is not supported"):
        _common.random_rows(
            1, n, torch.Generator().manual_seed(5), device=torch.device("meta"), dtype=torch.float32
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unconverged_power_iteration_gives_the_cpu_numbers_on_cuda() -> None:
    """A step budget that stops power iteration early leaves a result that depends on the
    start vector: on CUDA it is the CPU's (a float64 operator: no TF32)."""
    m = dense_matrix(np.concatenate([[1.0, 0.99, 0.98], np.linspace(0.9, 0.0, 97)]), seed=0)
    results = []
    for device in ("cpu", "cuda"):
        mt = torch.as_tensor(m, device=device)
        op = LambdaOperator(lambda v, mt=mt: mt @ v, 100, device=device, dtype=torch.float64)
        with pytest.warns(ConvergenceWarning):  # unconverged, on purpose
            res = deflated_power_iteration(op, k=2, max_iter=15, tol=1e-12, seed=3)
        results.append(res.eigenvalues.numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-10)
