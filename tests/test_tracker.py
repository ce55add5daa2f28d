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

from hessian_eigenthings.algorithms import lanczos
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


def test_fused_optimizer_steps_are_seen() -> None:
    """A fused AdamW step leaves the parameters' version counters alone (torch 2.13); the
    tracker must still compute at the new parameters (NOTE [tracker drops kept graphs])."""
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
