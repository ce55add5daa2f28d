"""loss_landscape: the losses against direct evaluation at moved copies of the model, the
curvature of an eigenvector slice against its eigenvalue, and the model left untouched."""

from __future__ import annotations

import copy
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from torch import nn

import hessian_eigenthings as he
from hessian_eigenthings.landscape import loss_landscape, random_directions
from hessian_eigenthings.param_utils import params_to_vector, vector_to_params

matplotlib.use("Agg")


def _data(n: int = 50, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]  # uneven last batch


def _model(bn: bool = False, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 6)]
    if bn:
        layers.append(nn.BatchNorm1d(6))
    layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(6, 3)]
    return nn.Sequential(*layers).double()


LOSS = he.supervised_loss(nn.CrossEntropyLoss())


def _direct(model: nn.Module, data: list, theta: torch.Tensor) -> float:
    """Mean loss over all samples at flat parameters ``theta`` (a moved deep copy)."""
    m = copy.deepcopy(model)
    vector_to_params(theta, list(m.parameters()))
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    with torch.no_grad():
        return float(nn.functional.cross_entropy(m(x), y))


def test_line_and_grid_equal_direct_evaluation() -> None:
    model, data = _model(), _data()
    theta = params_to_vector(list(model.parameters())).detach()
    line = loss_landscape(model, data, LOSS, dims=1, span=0.5, steps=5, seed=3)
    assert line.losses.shape == (5,) and line.betas is None
    for a, value in zip(line.alphas.tolist(), line.losses.tolist(), strict=True):
        assert value == pytest.approx(
            _direct(model, data, theta + a * line.directions[0]), rel=1e-12
        )
    assert line.center_loss == pytest.approx(_direct(model, data, theta), rel=1e-12)
    assert float(line.losses[2]) == pytest.approx(line.center_loss, rel=1e-12)  # alpha = 0

    grid = loss_landscape(model, data, LOSS, dims=2, span=0.3, steps=3, seed=3)
    assert grid.losses.shape == (3, 3)
    # the same seed gives the same first direction in 1-D and 2-D
    torch.testing.assert_close(grid.directions[0], line.directions[0], rtol=0, atol=0)
    for i, a in enumerate(grid.alphas.tolist()):
        for j, b in enumerate(grid.betas.tolist()):  # type: ignore[union-attr]
            moved = theta + a * grid.directions[0] + b * grid.directions[1]
            assert float(grid.losses[i, j]) == pytest.approx(_direct(model, data, moved), rel=1e-12)


def test_eigenvector_slice_curves_by_its_eigenvalue() -> None:
    """Along a unit Hessian eigenvector d with eigenvalue λ the second difference of the slice
    is λ (plus O(a²)): an independent check of the directions' scaling and layout."""
    model, data = _model(), _data()
    op = he.HessianOperator(model, data, LOSS)
    eig = he.algorithms.lanczos(op, k=1, which="LA", tol=1e-10, seed=0)
    a = 1e-3
    res = loss_landscape(model, data, LOSS, directions=eig, span=a, steps=3)
    second = float(res.losses[0] + res.losses[2] - 2 * res.losses[1]) / a**2
    assert second == pytest.approx(float(eig.eigenvalues[0]), rel=1e-4)
    assert res.kind == "eigenvectors"


def test_filter_normalised_directions() -> None:
    model = _model()
    d = random_directions(model, 2, seed=1)
    assert d.shape == (2, sum(p.numel() for p in model.parameters()))
    offset = 0
    for p in model.parameters():
        part = d[:, offset : offset + p.numel()].reshape(2, *p.shape)
        offset += p.numel()
        if p.dim() == 1:
            assert bool((part == 0).all())  # biases stay put
        else:
            torch.testing.assert_close(part[0].norm(dim=1), p.detach().norm(dim=1))
    torch.testing.assert_close(random_directions(model, 2, seed=1), d, rtol=0, atol=0)
    assert not torch.equal(random_directions(model, 2, seed=2), d)
    raw = random_directions(model, 1, normalization="none", seed=1)
    assert bool((raw != 0).all())


def test_model_rng_and_buffers_untouched() -> None:
    model, data = _model(bn=True), _data()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    versions = [p._version for p in model.parameters()]
    rng = torch.get_rng_state()
    loss_landscape(model, data, LOSS, dims=2, span=0.2, steps=3)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [p._version for p in model.parameters()] == versions
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # BatchNorm running statistics included
    assert model.training


def test_one_shot_iterable_and_param_filter() -> None:
    model, data = _model(), _data()
    full = loss_landscape(model, data, LOSS, span=0.4, steps=3, param_filter="3.*", seed=0)
    assert full.names == ["3.weight", "3.bias"]
    once = loss_landscape(
        model, (b for b in data), LOSS, span=0.4, steps=3, param_filter="3.*", seed=0
    )
    torch.testing.assert_close(once.losses, full.losses, rtol=0, atol=0)
    two = loss_landscape(
        model, data, LOSS, span=0.4, steps=3, num_batches=2, param_filter="3.*", seed=0
    )
    assert not torch.equal(two.losses, full.losses)


def test_bad_arguments_are_named() -> None:
    model, data = _model(), _data()
    with pytest.raises(ValueError, match="dims"):
        loss_landscape(model, data, LOSS, dims=3)
    with pytest.raises(ValueError, match="span"):
        loss_landscape(model, data, LOSS, span=0.0)
    with pytest.raises(ValueError, match="steps"):
        loss_landscape(model, data, LOSS, steps=True)
    with pytest.raises(ValueError, match="length"):
        loss_landscape(model, data, LOSS, directions=torch.ones(1, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="directions"):
        loss_landscape(model, data, LOSS, directions="eigen")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no batch"):
        loss_landscape(model, [], LOSS)


def test_dropout_in_training_mode_warns() -> None:
    model, data = _model(dropout=0.5), _data()
    model.train()
    with pytest.warns(he.RandomForwardWarning, match="eval"):
        loss_landscape(model, data, LOSS, steps=2)


def test_plots(tmp_path: Path) -> None:
    model, data = _model(), _data()
    for dims in (1, 2):
        res = loss_landscape(model, data, LOSS, dims=dims, steps=3)
        ax = res.plot()
        ax.figure.savefig(tmp_path / f"l{dims}.png")
        assert (tmp_path / f"l{dims}.png").stat().st_size > 1000


def test_plot_marks_the_parameters_and_overlays_the_quadratic_model() -> None:
    """An eigenvector slice: the style of spectrum.png (grid), a marker at the trained point,
    the second-order model L(θ) + λα²/2 over the measured curve, equal axes on a grid, and a
    title that names the eigenvalues (the same on the command line)."""
    import matplotlib.pyplot as plt

    model, data = _model(), _data()
    eig = he.lanczos(he.HessianOperator(model, data, LOSS), k=2, which="SA", seed=0)
    line = loss_landscape(model, data, LOSS, directions=eig, dims=1, span=0.5, steps=5)
    assert line.eigenvalues is not None
    torch.testing.assert_close(line.eigenvalues, eig.eigenvalues[:1])
    ax = line.plot()
    try:
        lam = float(eig.eigenvalues[0])
        assert ax.get_title() == f"loss along the eigenvector of λ = {lam:.3g}"
        assert any(g.get_visible() for g in ax.get_xgridlines())
        (center,) = [
            ln
            for ln in ax.get_lines()
            if ln.get_marker() not in ("None", "", None) and len(ln.get_xdata()) == 1
        ]
        assert float(center.get_xdata()[0]) == 0.0 and float(
            center.get_ydata()[0]
        ) == pytest.approx(line.center_loss)
        (model2,) = [ln for ln in ax.get_lines() if "λα²/2" in str(ln.get_label())]
        a = np.asarray(model2.get_xdata(), dtype=float)
        np.testing.assert_allclose(
            model2.get_ydata(), line.center_loss + 0.5 * lam * a**2, rtol=1e-12
        )
        assert a.min() == pytest.approx(-0.5) and a.max() == pytest.approx(0.5)
    finally:
        plt.close(ax.figure)

    grid = loss_landscape(model, data, LOSS, directions=eig, dims=2, span=0.5, steps=3)
    ax = grid.plot()
    try:
        values = ", ".join(f"{float(v):.3g}" for v in eig.eigenvalues)
        assert ax.get_title() == f"loss along the eigenvectors of λ = {values}"
        assert ax.get_aspect() == 1.0
        (center,) = [ln for ln in ax.get_lines() if ln.get_marker() not in ("None", "", None)]
        assert (float(center.get_xdata()[0]), float(center.get_ydata()[0])) == (0.0, 0.0)
        # filled contours of the measured grid, drawn on a finer, smoothly interpolated grid
        filled = [c for c in ax.collections if getattr(c, "filled", False)]
        assert filled
        assert any("λ₁α²/2" in str(h.get_label()) for h in ax.get_legend().legend_handles)
    finally:
        plt.close(ax.figure)

    rnd = loss_landscape(model, data, LOSS, dims=2, span=0.5, steps=3)
    ax = rnd.plot()
    try:
        assert rnd.eigenvalues is None
        assert ax.get_title() == "loss along 2 random (filter-normalised) directions"
    finally:
        plt.close(ax.figure)
