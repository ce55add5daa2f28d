"""Stochastic Lanczos quadrature against the smoothed true eigenvalue histogram."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hessian_eigenthings.algorithms import spectral_density
from hessian_eigenthings.algorithms.spectral_density import gaussian_density
from hessian_eigenthings.operators.base import LambdaOperator
from tests.algorithms.spectra import CountingOp, dense_matrix, dense_op, diag_op


def _l1(a: torch.Tensor, b: torch.Tensor, grid: torch.Tensor) -> float:
    return float(torch.trapezoid((a - b).abs(), grid))


def _reflected_diagonal(d: np.ndarray, seed: int) -> LambdaOperator:
    """``H diag(d) H`` with a Householder reflection ``H``: O(n) products, and not
    diagonal (for a diagonal operator Rademacher probes make SLQ exact)."""
    w = torch.as_tensor(np.random.default_rng(seed).standard_normal(len(d)))
    w /= w.norm()
    dt = torch.as_tensor(d)

    def rows(x: torch.Tensor) -> torch.Tensor:
        x = x - 2.0 * (x @ w)[:, None] * w
        x = x * dt
        return x - 2.0 * (x @ w)[:, None] * w

    return LambdaOperator(lambda v: rows(v[None])[0], len(d), dtype=torch.float64, matmat_fn=rows)


@pytest.mark.parametrize("kind", ["bimodal", "powerlaw"])
def test_density_close_to_smoothed_truth(kind: str) -> None:
    """Metric: L1 distance between SLQ's density and the true eigenvalues smoothed with
    the same sigma, on SLQ's grid (0 = identical, 2 = disjoint). Measured: ~0.01 with
    40 steps (0.3-0.7 with 8 steps, which cannot resolve sigma); threshold 0.03."""
    n = 5000
    rng = np.random.default_rng(0)
    if kind == "bimodal":
        d = np.concatenate([rng.normal(-1.0, 0.1, n // 2), rng.normal(2.0, 0.3, n - n // 2)])
    else:
        d = 1.0 / rng.uniform(0.05, 1.0, n) ** 2 / 100
    op = _reflected_diagonal(d, seed=1)
    res = spectral_density(
        op, num_runs=10, lanczos_steps=40, num_grid_points=4000, sigma=0.05, seed=0
    )
    truth = gaussian_density(
        torch.as_tensor(d), torch.full((n,), 1.0 / n, dtype=torch.float64), res.grid, 0.05
    )
    assert _l1(res.density, truth, res.grid) < 0.03
    assert float(torch.trapezoid(res.density, res.grid)) == pytest.approx(1.0, abs=1e-3)
    # one row per run, each row's weights sum to 1 (the 1.0 alpha's layout)
    assert res.raw_eigenvalues.shape == res.raw_weights.shape == (10, 40)
    torch.testing.assert_close(res.raw_weights.sum(dim=1), torch.ones(10, dtype=torch.float64))
    assert float(res.quadrature()[1].sum()) == pytest.approx(1.0, abs=1e-12)


def test_exact_for_small_operator() -> None:
    """n <= lanczos_steps: each run is exhausted and the nodes are the eigenvalues."""
    eigs = np.array([-2.0, -1.0, 0.5, 1.0, 3.0])
    res = spectral_density(
        dense_op(dense_matrix(eigs)), num_runs=3, lanczos_steps=80, seed=0, num_grid_points=500
    )
    nodes = res.quadrature()[0].numpy()
    for e in eigs:
        assert np.abs(nodes - e).min() < 1e-10
    # each run is exhausted after n = 5 steps: (num_runs, 5), no padding
    assert res.raw_eigenvalues.shape == (3, 5) and nodes.shape == (15,)


def test_runs_go_in_lockstep_blocks() -> None:
    m = torch.as_tensor(dense_matrix(np.linspace(-1.0, 1.0, 100)))
    op = CountingOp(m)
    spectral_density(op, num_runs=6, lanczos_steps=10, seed=0, num_grid_points=100)
    assert op.num_matvecs == 60 and op.passes == 10
    op2 = CountingOp(m)
    # a budget for two bases at a time: three lockstep groups
    spectral_density(
        op2,
        num_runs=6,
        lanczos_steps=10,
        seed=0,
        num_grid_points=100,
        memory_budget=2 * 10 * 100 * 8,
    )
    assert op2.passes == 30


def test_default_sigma_grid_and_reproducibility() -> None:
    op = diag_op(np.linspace(0.0, 1.0, 500))
    a = spectral_density(op, num_runs=2, lanczos_steps=20, seed=1, num_grid_points=300)
    b = spectral_density(op, num_runs=2, lanczos_steps=20, seed=1, num_grid_points=300)
    assert torch.equal(a.density, b.density)
    assert a.grid.shape == (300,) and a.sigma > 0
    assert float(a.grid[0]) < 0.0 and float(a.grid[-1]) > 1.0
    no_reorth = spectral_density(
        op, num_runs=2, lanczos_steps=20, seed=1, num_grid_points=300, reorthogonalize=False
    )
    assert float(torch.trapezoid(no_reorth.density, no_reorth.grid)) == pytest.approx(1.0, abs=1e-3)


def test_plot() -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    res = spectral_density(
        diag_op(np.linspace(0.0, 1.0, 50)), num_runs=2, lanczos_steps=10, seed=0, num_grid_points=50
    )
    ax = res.plot()
    assert ax.get_yscale() == "log"
    # a floor under the Gaussian tails (on wide grids they reach 1e-28 of the peak), a title with σ
    peak = float(res.density.max())
    lo, hi = ax.get_ylim()
    assert lo == pytest.approx(peak * 1e-7) and hi == pytest.approx(peak * 3)
    assert f"σ = {res.sigma:.2g}" in ax.get_title()
    assert res.plot(title="mine", floor=1e-3).get_title() == "mine"
    with pytest.raises(ValueError, match="floor must be"):
        res.plot(floor=0.0)


def test_errors() -> None:
    op = diag_op(np.linspace(0.0, 1.0, 50))
    with pytest.raises(ValueError, match="num_runs must be"):
        spectral_density(op, num_runs=0)
    with pytest.raises(ValueError, match="sigma must be"):
        spectral_density(op, sigma=-1.0)
