"""HessianTrackerLightningCallback in a Lightning Trainer (tiny MLP with dropout, CPU)."""

from __future__ import annotations

import csv
import importlib.util

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PACKAGE = next(
    (
        p
        for p in ("lightning.pytorch", "pytorch_lightning")
        if importlib.util.find_spec(p.split(".")[0])
    ),
    None,
)
if PACKAGE is None:
    pytest.skip(
        "needs the lightning (or pytorch-lightning) package: pip install -e '.[lightning]'",
        allow_module_level=True,
    )
pl = pytest.importorskip(PACKAGE)
loggers = pytest.importorskip(f"{PACKAGE}.loggers")

from hessian_eigenthings.algorithms import lanczos  # noqa: E402
from hessian_eigenthings.operators import HessianOperator  # noqa: E402
from hessian_eigenthings.tracking import CurvatureTracker  # noqa: E402
from hessian_eigenthings.tracking_lightning import (  # noqa: E402
    HessianTrackerLightningCallback,
    lightning_callback_class,
)

# Lightning's advice for real runs (its other noise is ignored in pyproject.toml)
pytestmark = pytest.mark.filterwarnings("ignore:.*`max_epochs` was not set")

CE = nn.CrossEntropyLoss()
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
PROBE = (X[:16], Y[:16])


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return CE(model(batch[0]), batch[1])


class Module(pl.LightningModule):  # type: ignore[misc,name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = CE(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _run(tmp_path, track: bool, accumulate: int = 1):  # type: ignore[no-untyped-def]
    pl.seed_everything(0, verbose=False)
    module = Module()
    tracker = (
        CurvatureTracker(module, loss_fn, batch=PROBE, every=2, k=2, trace=True) if track else None
    )
    callbacks = [HessianTrackerLightningCallback(tracker)] if tracker is not None else []
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=loggers.CSVLogger(str(tmp_path), name="t" if track else "p"),
        log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True,
    )
    # shuffle: the global RNG draws the batch order each epoch, dropout draws masks
    loader = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    trainer.fit(module, loader)
    return module, tracker, trainer


def test_lightning_callback_logs_and_leaves_training_untouched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plain, _, _ = _run(tmp_path, track=False)
    module, tracker, trainer = _run(tmp_path, track=True)
    assert tracker is not None
    assert len(plain.losses) == 6 and module.losses == plain.losses  # bit-identical
    for a, b in zip(plain.state_dict().values(), module.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # global_step after the 1st..6th optimizer step is 1..6; every=2
    assert [r.step for r in tracker.history] == [2, 4, 6]
    with open(trainer.logger.log_dir + "/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): r for r in rows if r.get("hessian/sharpness")}
    assert sorted(logged) == [2, 4, 6]
    for rec in tracker.history:
        assert float(logged[rec.step]["hessian/sharpness"]) == pytest.approx(rec.eigenvalues[0])
        assert float(logged[rec.step]["hessian/eigenvalue_1"]) == pytest.approx(rec.eigenvalues[1])
        assert float(logged[rec.step]["hessian/trace"]) == pytest.approx(rec.trace)
    assert float(trainer.callback_metrics["hessian/sharpness"]) == pytest.approx(
        tracker.history[-1].eigenvalues[0]
    )
    module.eval()
    cold = lanczos(HessianOperator(module, [PROBE], loss_fn), k=2, which="LA", seed=1)
    np.testing.assert_allclose(tracker.history[-1].eigenvalues, cold.eigenvalues.numpy(), rtol=1e-4)


def test_lightning_callback_counts_optimizer_steps_under_accumulation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, tracker, trainer = _run(tmp_path, track=True, accumulate=2)
    assert tracker is not None and trainer.global_step == 6
    # the hook runs on 12 batches; only the 6 that end with an optimizer step count
    assert [r.step for r in tracker.history] == [2, 4, 6]


def test_lightning_callback_class_and_arguments() -> None:
    assert issubclass(HessianTrackerLightningCallback, pl.Callback)
    assert lightning_callback_class(PACKAGE) is HessianTrackerLightningCallback
    if importlib.util.find_spec("pytorch_lightning") is not None:  # both packages installed
        import pytorch_lightning

        other = lightning_callback_class("pytorch_lightning")
        assert issubclass(other, pytorch_lightning.Callback)
        assert isinstance(other(CurvatureTracker(Module(), loss_fn, batch=PROBE)), other)
    with pytest.raises(ValueError, match="package must be"):
        lightning_callback_class("keras")
    with pytest.raises(TypeError, match="CurvatureTracker"):
        HessianTrackerLightningCallback(object())
