"""Every public name of the 1.0 alpha releases (1.0.0a5, 1.0.0a6) imports from the same path.

The table was read from the alphas' sources (their ``__all__`` lists, or the
public definitions of modules without one); private modules are left out.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from torch import nn

from hessian_eigenthings.algorithms import ConvergenceWarning, deflated_power_iteration, lanczos
from hessian_eigenthings.batching import (
    assert_microbatch_safe,
    iterate_batches,
    move_batch_to_device,
)
from hessian_eigenthings.linalg import SingleDeviceBackend
from hessian_eigenthings.operators import LambdaOperator

ALPHA_NAMES: dict[str, tuple[str, ...]] = {
    "hessian_eigenthings": (
        "CurvatureOperator", "DDPHessianOperator", "EigenResult", "EmpiricalFisherOperator",
        "GGNOperator", "HessianOperator", "LambdaOperator", "LanczosTridiag", "ParamFilter",
        "SpectralDensityResult", "TraceResult", "__version__", "deflated_power_iteration",
        "hf_lm_forward", "hf_lm_loss", "hf_lm_loss_of_output", "hf_seq2seq_loss",
        "hutch_plus_plus", "hutchinson", "lanczos", "lanczos_tridiagonal", "match_names",
        "match_regex", "params_to_vector", "power_iteration_one", "select_parameters",
        "spectral_density", "supervised_forward", "supervised_loss", "supervised_loss_of_output",
        "supervised_per_sample_loss", "tlens_forward", "tlens_loss", "tlens_loss_of_output",
        "trace", "vector_to_params",
    ),
    "hessian_eigenthings.algorithms": (
        "EigenResult", "LanczosTridiag", "SpectralDensityResult", "TraceResult",
        "deflated_power_iteration", "hutch_plus_plus", "hutchinson", "lanczos",
        "lanczos_tridiagonal", "power_iteration_one", "spectral_density", "trace",
    ),
    "hessian_eigenthings.algorithms.lanczos": ("LanczosTridiag", "Which", "lanczos", "lanczos_tridiagonal"),
    "hessian_eigenthings.algorithms.power_iteration": ("deflated_power_iteration", "power_iteration_one"),
    "hessian_eigenthings.algorithms.result": ("EigenResult",),
    "hessian_eigenthings.algorithms.spectral_density": ("SpectralDensityResult", "spectral_density"),
    "hessian_eigenthings.algorithms.trace": (
        "Distribution", "Method", "TraceResult", "hutch_plus_plus", "hutchinson", "trace",
    ),
    "hessian_eigenthings.batching": ("assert_microbatch_safe", "iterate_batches", "move_batch_to_device"),
    "hessian_eigenthings.linalg": ("LinAlgBackend", "SingleDeviceBackend"),
    "hessian_eigenthings.loss_fns": (
        "cross_entropy_loss_of_output", "hf_lm_forward", "hf_lm_loss", "hf_lm_loss_of_output",
        "hf_seq2seq_loss", "mse_loss_of_output", "supervised_forward", "supervised_loss",
        "supervised_loss_of_output", "supervised_per_sample_loss", "tlens_forward", "tlens_loss",
        "tlens_loss_of_output",
    ),
    "hessian_eigenthings.loss_fns.huggingface": (
        "FusedCEHvpBackend", "LossHvpFn", "hf_lm_forward", "hf_lm_loss", "hf_lm_loss_of_output",
        "hf_seq2seq_loss",
    ),
    "hessian_eigenthings.loss_fns.standard": (
        "cross_entropy_loss_of_output", "mse_loss_of_output", "supervised_forward",
        "supervised_loss", "supervised_loss_of_output", "supervised_per_sample_loss",
    ),
    "hessian_eigenthings.loss_fns.transformer_lens": ("tlens_forward", "tlens_loss", "tlens_loss_of_output"),
    "hessian_eigenthings.operators": (
        "CurvatureOperator", "DDPHessianOperator", "EmpiricalFisherOperator", "ForwardFn",
        "GGNOperator", "HessianOperator", "HvpMethod", "LambdaOperator", "LossFn",
        "LossOfOutputFn", "PerSampleLossFn",
    ),
    "hessian_eigenthings.operators.base": ("CurvatureOperator", "LambdaOperator"),
    "hessian_eigenthings.operators.distributed": ("DDPHessianOperator",),
    "hessian_eigenthings.operators.fisher": ("EmpiricalFisherOperator", "PerSampleLossFn"),
    "hessian_eigenthings.operators.ggn": ("ForwardFn", "GGNOperator", "LossHvpMethod", "LossOfOutputFn"),
    "hessian_eigenthings.operators.hessian": ("HessianOperator", "HvpMethod", "LossFn"),
    "hessian_eigenthings.param_utils": (
        "ParamFilter", "match_names", "match_regex", "params_to_vector", "select_parameters",
        "total_size", "vector_to_params",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("module", "names"), sorted(ALPHA_NAMES.items()))
def test_alpha_public_names_import_from_the_alpha_paths(
    module: str, names: tuple[str, ...]
) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in names if not hasattr(mod, name)]
    assert not missing, f"{module} lacks the 1.0 alpha's {missing}"


# -- the alpha's contracts, where ours differed --------------------------------------------------


def _wishart(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (a.T @ a) / n


def test_lanczos_explicit_budget_bounds_every_product() -> None:
    M = _wishart(40, 6)
    op = LambdaOperator(lambda v: M @ v, 40, dtype=torch.float64)
    with pytest.warns(ConvergenceWarning):  # 15 products cannot reach tol=1e-9
        res = lanczos(op, k=3, max_iter=15, tol=1e-9, seed=6)
    assert res.iterations <= 15 and op.num_matvecs == res.iterations


def test_lanczos_budget_of_the_whole_space_is_exact() -> None:
    M = _wishart(60, 2) - 0.5 * torch.eye(60, dtype=torch.float64)
    op = LambdaOperator(lambda v: M @ v, 60, dtype=torch.float64)
    res = lanczos(op, k=3, max_iter=60, tol=1e-9, which="SA", seed=2)
    expected = torch.from_numpy(np.sort(np.linalg.eigvalsh(M.numpy()))[:3])
    torch.testing.assert_close(res.eigenvalues, expected, rtol=1e-10, atol=1e-12)
    assert res.iterations <= 60


def test_k_beyond_the_size_says_so_in_the_alphas_words() -> None:
    op = LambdaOperator(lambda v: 2.0 * v, 10, dtype=torch.float64)
    for solver in (lanczos, deflated_power_iteration):
        with pytest.raises(ValueError, match="exceeds operator size"):
            solver(op, k=11)


def test_single_device_backend_vector_helpers() -> None:
    be = SingleDeviceBackend()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, generator=g), torch.randn(7, generator=g)
    torch.testing.assert_close(be.axpy(0.5, a, b), 0.5 * a + b)
    torch.testing.assert_close(be.axpy(torch.tensor(2.0), a, b), 2.0 * a + b)
    torch.testing.assert_close(be.scale(-3.0, a), -3.0 * a)
    assert torch.equal(be.zeros_like(a), torch.zeros(7))
    r1 = be.randn_like(a, generator=torch.Generator().manual_seed(4))
    r2 = be.randn_like(a, generator=torch.Generator().manual_seed(4))
    assert torch.equal(r1, r2) and r1.dtype == a.dtype
    signs = be.rademacher_like(torch.empty(4000, dtype=torch.float64), generator=g)
    assert set(signs.unique().tolist()) == {-1.0, 1.0} and abs(float(signs.mean())) < 0.1


def test_alpha_batching_helpers() -> None:
    assert list(iterate_batches([1, 2, 3, 4], num_batches=2)) == [1, 2]
    assert list(iterate_batches([1, 2, 3])) == [1, 2, 3]
    moved = move_batch_to_device({"x": torch.zeros(2), "label": "kept"}, torch.device("cpu"))
    assert moved["label"] == "kept" and moved["x"].device.type == "cpu"
    assert_microbatch_safe(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)))
    with pytest.raises(ValueError, match="BatchNorm"):
        assert_microbatch_safe(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
