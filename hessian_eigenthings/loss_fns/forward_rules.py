"""Losses computed from elementwise operations while a product is traced (NOTE [losses without
forward-mode rules]): the same values, with derivatives every ``torch.func`` transform handles.

Cost: nothing outside a trace (the mode is active only while an engine traces a product).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# NOTE [losses without forward-mode rules]
# Forward-over-reverse needs the forward-mode derivative of each loss's
# backward. In torch 2.13 that of `mse_loss_backward` is broken (eagerly
# "ZeroTensors are immutable"; under make_fx the process dies with a
# segmentation fault), and `huber_loss_backward` and
# `soft_margin_loss_backward` have none. While an engine traces a product,
# these losses are computed from elementwise operations instead (same values;
# a torch function mode, active for the trace only, so nothing of the user's
# changes), which every transform handles.


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _mse(input: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    a, b = torch.broadcast_tensors(input, target)
    d = a - b
    return _reduce(d * d, reduction)


def _huber(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "mean", delta: float = 1.0
) -> torch.Tensor:
    a, b = torch.broadcast_tensors(input, target)
    d = (a - b).abs()
    return _reduce(torch.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta)), reduction)


def _soft_margin(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    return _reduce(nn.functional.softplus(-target * input), reduction)


ELEMENTWISE_LOSSES: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {
    nn.functional.mse_loss: _mse,
    nn.functional.huber_loss: _huber,
    nn.functional.soft_margin_loss: _soft_margin,
}


class ElementwiseLosses(torch.overrides.TorchFunctionMode):
    """See NOTE [losses without forward-mode rules]."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        impl = ELEMENTWISE_LOSSES.get(func)
        if impl is None:
            return func(*args, **kwargs)
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        # the legacy size_average/reduce arguments and a per-element weight keep torch's own code
        if any(given.pop(k, None) is not None for k in ("size_average", "reduce", "weight")):
            return func(*args, **kwargs)
        return impl(**given)
