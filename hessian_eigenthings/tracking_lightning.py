"""A PyTorch Lightning ``Callback`` that runs a :class:`CurvatureTracker`.

Optional: importing this module imports Lightning (the package itself never does), as
``lightning.pytorch`` when the ``lightning`` package is installed, else ``pytorch_lightning``.

    from hessian_eigenthings.tracking_lightning import HessianTrackerLightningCallback
    trainer = lightning.pytorch.Trainer(callbacks=[HessianTrackerLightningCallback(tracker)])

A Trainer accepts only callbacks of its own package: with both installed, code that trains
with ``pytorch_lightning.Trainer`` takes ``lightning_callback_class("pytorch_lightning")``.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from hessian_eigenthings.tracking import CurvatureTracker, TrackRecord

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class _TrackerHooks:
    """The hooks, written once for both Lightning packages (see :func:`lightning_callback_class`)."""

    def __init__(
        self, tracker: CurvatureTracker, *, log: bool = True, prefix: str = "hessian/"
    ) -> None:
        if not isinstance(tracker, CurvatureTracker):
            raise TypeError(f"tracker must be a CurvatureTracker, got {type(tracker).__name__}")
        super().__init__()
        self.tracker = tracker
        self.log = log
        self.prefix = prefix
        self._last_step: int | None = None

    def metrics(self, rec: TrackRecord) -> dict[str, float]:
        """The scalars logged for a record: sharpness, each eigenvalue, trace, products."""
        p = self.prefix
        out = {f"{p}sharpness": rec.eigenvalues[0]}
        out.update({f"{p}eigenvalue_{i}": v for i, v in enumerate(rec.eigenvalues)})
        if rec.trace is not None:
            out[f"{p}trace"] = rec.trace
        out[f"{p}products"] = float(rec.products)
        return out

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._last_step = int(trainer.global_step)  # 0, or the step a resumed run starts at

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # NOTE [lightning step]. trainer.global_step counts optimizer steps and has already
        # advanced when this hook runs after a step (1 after the first, as the HF Trainer's
        # state.global_step). With gradient accumulation the hook runs on every batch, but the
        # parameters change only when global_step does: only those batches count as a step.
        step = int(trainer.global_step)
        if step == self._last_step:
            return
        self._last_step = step
        rec = self.tracker.step(step)
        if rec is None or not self.log:
            return
        values = self.metrics(rec)
        # the loggers directly, at this step: pl_module.log would hand them over only on the
        # Trainer's log_every_n_steps schedule, which need not meet the tracker's
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        # and callback_metrics (for ModelCheckpoint / EarlyStopping monitors, the progress bar)
        for name, value in values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, logger=False)


@cache
def lightning_callback_class(package: str = "auto") -> type:
    """The callback class built on ``package``'s ``Callback``: ``"lightning.pytorch"``,
    ``"pytorch_lightning"``, or ``"auto"`` (the first of them that imports)."""
    if package == "auto":
        for name in _PACKAGES:
            try:
                return lightning_callback_class(name)
            except ImportError:
                continue
        raise ImportError(
            "HessianTrackerLightningCallback needs Lightning: pip install lightning "
            "(or pytorch-lightning)"
        )
    if package not in _PACKAGES:
        raise ValueError(f"package must be 'auto' or one of {_PACKAGES}, got {package!r}")
    callback = importlib.import_module(package).Callback
    return type(
        "HessianTrackerLightningCallback",
        (_TrackerHooks, callback),
        {
            "__module__": __name__,
            "__doc__": _DOC,
            "__qualname__": "HessianTrackerLightningCallback",
        },
    )


_DOC = """Calls ``tracker.step(trainer.global_step)`` after each optimizer step (NOTE [lightning
step]); due records go to every logger of the Trainer at that step as ``hessian/sharpness``,
``hessian/eigenvalue_<i>``, ``hessian/trace`` and ``hessian/products`` (``prefix=``), and to
``trainer.callback_metrics``, unless ``log=False``. Training is untouched (NOTE [tracker leaves
training untouched])."""

HessianTrackerLightningCallback: type = lightning_callback_class()

__all__ = ["HessianTrackerLightningCallback", "lightning_callback_class"]
