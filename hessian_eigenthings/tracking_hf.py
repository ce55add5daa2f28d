"""A HuggingFace ``transformers.TrainerCallback`` that runs a :class:`CurvatureTracker`.

Optional: importing this module imports ``transformers`` (the package itself never does).

    from hessian_eigenthings.tracking_hf import HessianTrackerCallback
    trainer.add_callback(HessianTrackerCallback(tracker))
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from hessian_eigenthings.tracking import CurvatureTracker, TrackRecord


class HessianTrackerCallback(TrainerCallback):
    """Calls ``tracker.step(state.global_step)`` at the end of every optimizer step; due
    records also go to the Trainer's ``log_history`` as ``{"step", "sharpness", ...}``
    entries unless ``log=False``."""

    def __init__(self, tracker: CurvatureTracker, *, log: bool = True) -> None:
        if not isinstance(tracker, CurvatureTracker):
            raise TypeError(f"tracker must be a CurvatureTracker, got {type(tracker).__name__}")
        self.tracker = tracker
        self.log = log

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        rec: TrackRecord | None = self.tracker.step(int(state.global_step))
        if rec is not None and self.log:
            entry: dict[str, Any] = {"step": rec.step, "sharpness": rec.eigenvalues[0]}
            entry["hessian_eigenvalues"] = rec.eigenvalues
            if rec.trace is not None:
                entry["hessian_trace"] = rec.trace
            entry["hessian_products"] = rec.products
            state.log_history.append(entry)
        return control
