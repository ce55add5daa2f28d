"""CurvatureTracker (issue 19): tracked sharpness equals cold Lanczos and a dense Hessian,
warm-started calls are cheaper, and training is bit-identical with and without tracking."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from hessian_eigenthings.algorithms import lanczos, spectral_density
from hessian_eigenthings.operators import HessianOperator
from hessian_eigenthings.tracking import CurvatureTracker, TrackRecord

CE = nn.CrossEntropyLoss()
X = torch.randn(64, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(2))
PROBE = (X[:32], Y[:32])


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return CE(model(batch[0]), batch[1])


def make_model(running_stats: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.BatchNorm1d(16, track_running_stats=running_stats),
        nn.Tanh(),
        nn.Dropout(0.2),
        nn.Linear(16, 3),
    ).double()


def train(
    model: nn.Module,
    tracker: CurvatureTracker | None,
    *,
    lr: float,
    momentum: float,
    steps: int = 20,
    snapshots: dict[int, dict[str, torch.Tensor]] | None = None,
) -> list[float]:
    """SGD on random minibatches (global RNG: the minibatch draw and the dropout masks)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model.train()
    losses = []
    for s in range(steps):
        idx = torch.randint(0, 64, (16,))
        opt.zero_grad()
        loss = CE(model(X[idx]), Y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if tracker is not None:
            rec = tracker.step()
            if rec is not None and snapshots is not None:
                snapshots[s] = copy.deepcopy(model.state_dict())
    return losses


@pytest.mark.parametrize("eval_mode", [True, False])
@pytest.mark.filterwarnings("ignore::UserWarning")  # eval_mode=False: dropout makes products random
def test_training_is_bit_identical_with_and_without_tracking(eval_mode: bool) -> None:
    plain = make_model()
    losses = train(plain, None, lr=0.05, momentum=0.9)
    tracked = make_model()
    # eval_mode=False: the tracker's forwards draw dropout masks from the global RNG and
    # BatchNorm updates running stats in training mode; the tracker must undo both
    tr = CurvatureTracker(
        tracked,
        loss_fn,
        batch=PROBE,
        every=5,
        k=2,
        trace=True,
        trace_matvecs=12,
        density_every=10,
        density_options={"num_runs": 2, "lanczos_steps": 10},
        eval_mode=eval_mode,
    )
    tracked_losses = train(tracked, tr, lr=0.05, momentum=0.9)
    assert [r.step for r in tr.history] == [0, 5, 10, 15]
    assert tracked_losses == losses  # bit-identical: dropout masks and minibatches unchanged
    for (name, a), b in zip(plain.state_dict().items(), tracked.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # parameters and BatchNorm running stats
    assert tracked.training and all(m.training for m in tracked.modules())
    assert torch.is_grad_enabled()
    assert all(r.trace is not None and np.isfinite(r.trace) for r in tr.history)
    assert [r.density is not None for r in tr.history] == [True, False, True, False]


def _dense_hessian(model: nn.Module) -> np.ndarray:
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for _, p in model.named_parameters()]
    shapes = [p.shape for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    buffers = dict(model.named_buffers())

    def f(v: torch.Tensor) -> torch.Tensor:
        parts = torch.split(v, [int(np.prod(s)) for s in shapes])
        state = {n: t.reshape(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return CE(functional_call(model, (state, buffers), (PROBE[0],)), PROBE[1])

    return torch.autograd.functional.hessian(f, flat).numpy()


def test_tracked_sharpness_matches_cold_lanczos_and_warm_calls_are_cheaper(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # NOTE: BatchNorm without running stats: in eval() a BatchNorm with running stats gives a
    # Hessian that moves with its stats on every training forward, whatever the learning rate,
    # and warm starts help only when the matrix moved little
    model = make_model(running_stats=False)
    tr = CurvatureTracker(model, loss_fn, batch=PROBE, every=5, k=2)  # tol 1e-4
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    train(model, tr, lr=1e-4, momentum=0.0, snapshots=snaps)
    products = [r.products for r in tr.history]
    assert len(products) == 4
    for p in products[1:]:
        assert p <= 0.5 * products[0], products
    for rec in tr.history:
        ref = make_model(running_stats=False)
        ref.load_state_dict(snaps[rec.step])
        ref.eval()
        cold = lanczos(HessianOperator(ref, [PROBE], loss_fn), k=2, which="LA", seed=1)
        np.testing.assert_allclose(rec.eigenvalues, cold.eigenvalues.numpy(), rtol=1e-6)
    # the last one against the dense Hessian too
    top = np.linalg.eigvalsh(_dense_hessian(ref))[::-1][:2]
    np.testing.assert_allclose(tr.history[-1].eigenvalues, top, rtol=1e-6)

    path = tmp_path / "track.jsonl"
    tr.to_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [TrackRecord(**r) for r in rows] == tr.history
    png = tmp_path / "sharpness.png"
    tr.plot(png, lr=1e-4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tracker_arguments() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="batch="):
        CurvatureTracker(model, loss_fn)
    with pytest.raises(ValueError, match="every"):
        CurvatureTracker(model, loss_fn, batch=PROBE, every=0)
    tr = CurvatureTracker(model, loss_fn, loader=[PROBE], every=3)
    assert [tr.step() is not None for _ in range(7)] == [
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    assert tr.step(step=9) is not None and tr.history[-1].step == 9


def test_residual_check_estimate_saves_k_products_per_call() -> None:
    """NOTE [tracker residual check]: the default checks convergence on the Lanczos estimates;
    ``residuals="exact"`` spends one block of ``k`` more products per call. Same eigenvalues."""
    runs = {}
    for residuals in ("estimate", "exact"):
        model = make_model(running_stats=False)
        tr = CurvatureTracker(model, loss_fn, batch=PROBE, every=5, k=2, residuals=residuals)
        widths: list[int] = []
        matmat = tr.operator.matmat

        def record(V: torch.Tensor, matmat=matmat, widths=widths) -> torch.Tensor:  # type: ignore[no-untyped-def]
            widths.append(V.shape[1])
            return matmat(V)

        tr.operator.matmat = record  # type: ignore[method-assign]
        train(model, tr, lr=1e-4, momentum=0.0)
        runs[residuals] = (tr.history, widths)
    estimate, exact = runs["estimate"][0], runs["exact"][0]
    assert len(estimate) == len(exact) == 4
    for a, b in zip(estimate, exact, strict=True):
        assert a.products == b.products - 2
        np.testing.assert_allclose(a.eigenvalues, b.eigenvalues, rtol=1e-10)
    assert runs["estimate"][1] == [] and runs["exact"][1] == [2] * 4  # the k-wide blocks
    with pytest.raises(ValueError, match="residuals"):
        CurvatureTracker(make_model(), loss_fn, batch=PROBE, residuals="true")  # type: ignore[arg-type]


def test_fused_optimizer_steps_are_seen() -> None:
    """A fused AdamW step leaves the parameters' version counters alone (torch 2.13); the
    tracker must still compute at the new parameters (NOTE [updates that keep the version])."""
    model = make_model(running_stats=False)
    tr = CurvatureTracker(model, loss_fn, batch=PROBE, every=1, k=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    tr.step()
    for _ in range(3):
        opt.zero_grad()
        CE(model(X), Y).backward()
        opt.step()
    rec = tr.step()
    assert rec is not None
    model.eval()
    cold = lanczos(
        HessianOperator(model, [PROBE], loss_fn, graph_reuse=False), k=1, which="LA", seed=1
    )
    assert rec.eigenvalues[0] == pytest.approx(float(cold.eigenvalues[0]), rel=1e-6)


def test_density_snapshots_and_warm_trace_match_cold_references(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The density snapshot is the quadrature of a cold ``spectral_density`` with the same seed
    and options; its top node is the dense Hessian's top eigenvalue; the warm-started trace
    spends the cold call's products and lands near the dense trace."""
    model = make_model(running_stats=False)
    tr = CurvatureTracker(
        model, loss_fn, batch=PROBE, every=5, k=1, trace=True, density_every=10, seed=3
    )
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    train(model, tr, lr=1e-3, momentum=0.0, steps=15, snapshots=snaps)
    assert [r.step for r in tr.history] == [0, 5, 10]
    assert [r.density is not None for r in tr.history] == [True, False, True]
    assert tr.last_trace is not None and tr.last_trace.sketch is not None
    # lanczos (warm: fewer) + 30 for the trace (warm: the same) + 4 x 30 for a density
    assert tr.history[0].products - tr.history[1].products > 120 - 30
    for rec in (tr.history[0], tr.history[2]):
        ref = make_model(running_stats=False)
        ref.load_state_dict(snaps[rec.step])
        ref.eval()
        op = HessianOperator(ref, [PROBE], loss_fn)
        cold = spectral_density(op, num_runs=4, lanczos_steps=30, num_grid_points=300, seed=3)
        keep = ~torch.isnan(cold.raw_eigenvalues)
        assert rec.density is not None
        np.testing.assert_allclose(rec.density["nodes"], cold.raw_eigenvalues[keep], atol=1e-9)
        np.testing.assert_allclose(rec.density["weights"], cold.raw_weights[keep] / 4, atol=1e-9)
        assert rec.density["sigma"] == pytest.approx(cold.sigma, rel=1e-9)
        grid, density = rec.density_curve(num_grid_points=300)
        np.testing.assert_allclose(grid, cold.grid, rtol=1e-9)
        np.testing.assert_allclose(density, cold.density, rtol=1e-6, atol=1e-9)
        dense = np.linalg.eigvalsh(_dense_hessian(ref))
        assert max(rec.density["nodes"]) == pytest.approx(dense[-1], rel=1e-6)
        assert sum(rec.density["weights"]) == pytest.approx(1.0, rel=1e-12)
        assert rec.trace is not None and rec.trace_stderr is not None
        assert abs(rec.trace - dense.sum()) < 4 * rec.trace_stderr, (rec.trace, dense.sum())
    with pytest.raises(ValueError, match="no density snapshot"):
        tr.history[1].density_curve()
    path = tmp_path / "track.jsonl"
    tr.to_jsonl(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [TrackRecord(**r) for r in rows] == tr.history
    with pytest.raises(ValueError, match="multiple of every=5"):
        CurvatureTracker(model, loss_fn, batch=PROBE, every=5, density_every=7)
    cold_tr = CurvatureTracker(model, loss_fn, batch=PROBE, trace=True, warm_start=False)
    cold_tr.step()
    assert cold_tr.last_trace is None


def test_kept_state_is_not_carried_between_calls() -> None:
    """NOTE [tracker frees kept states]: each call builds its state anew and leaves none behind
    for the training steps in between (one forward per call on the probe batch)."""
    model = make_model(running_stats=False)
    tr = CurvatureTracker(model, loss_fn, batch=PROBE, every=1, k=1)
    tr.step()
    op = tr.operator
    after_first = op.num_forwards
    tr.step()  # same parameters: a kept state would have answered without a forward
    assert op.num_forwards == after_first + 1
    assert op.held_bytes == 0


def test_plot_shows_every_eigenvalue_the_trace_and_a_readable_range(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = make_model(running_stats=False)
    tr = CurvatureTracker(model, loss_fn, batch=PROBE, every=5, k=3, trace=True, trace_matvecs=9)
    train(model, tr, lr=1e-2, momentum=0.0, steps=11)
    assert len(tr.history) == 3
    fig = tr.plot(tmp_path / "far.png", lr=1e-4)  # 2/lr = 20000: far above the sharpness
    assert (tmp_path / "far.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    eig_ax, trace_ax = fig.axes
    assert fig._suptitle is not None and "Hessian" in fig._suptitle.get_text()
    lines = [ln for ln in eig_ax.get_lines() if str(ln.get_label()).startswith("λ")]
    assert len(lines) == 3
    for i, ln in enumerate(lines):
        np.testing.assert_allclose(ln.get_ydata(), [r.eigenvalues[i] for r in tr.history])
    top = max(max(r.eigenvalues) for r in tr.history)
    assert eig_ax.get_ylim()[1] < 2 * top  # the curve fills the axes, not the floor
    assert not any("2/lr" in str(ln.get_label()) for ln in eig_ax.get_lines())
    assert any("2/lr = 20000" in t.get_text() for t in eig_ax.texts)  # said, off the scale
    np.testing.assert_allclose(trace_ax.get_lines()[0].get_ydata(), [r.trace for r in tr.history])

    near = tr.plot(tmp_path / "near.png", lr=2.0 / (1.2 * top))  # 2/lr just above the sharpness
    (edge,) = [ln for ln in near.axes[0].get_lines() if "2/lr" in str(ln.get_label())]
    assert float(edge.get_ydata()[0]) == pytest.approx(1.2 * top)
    assert near.axes[0].get_ylim()[1] > 1.2 * top

    no_trace = CurvatureTracker(make_model(running_stats=False), loss_fn, batch=PROBE, k=1)
    no_trace.compute(0)
    assert len(no_trace.plot(tmp_path / "one.png").axes) == 1
