"""Catch the two commonest wrong loss arguments when an operator is built, not at its first product.

- A criterion module (``nn.CrossEntropyLoss()``, the 0.x habit) where a function of
  ``(model, batch)`` is expected: it would be called as ``criterion(model, batch)``.
- A helper factory passed without calling it (``hf_lm_loss`` instead of ``hf_lm_loss()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hessian_eigenthings.loss_fns.huggingface import (
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_lm_per_sequence_loss,
    hf_lm_per_token_loss,
    hf_seq2seq_loss,
)
from hessian_eigenthings.loss_fns.standard import (
    cross_entropy_loss_of_output,
    mse_loss_of_output,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)
from hessian_eigenthings.loss_fns.transformer_lens import (
    tlens_forward,
    tlens_loss,
    tlens_loss_of_output,
)

#: factories that take no argument (call them) and those that take the criterion
_NO_ARGUMENT: tuple[Callable[..., Any], ...] = (
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_lm_per_sequence_loss,
    hf_lm_per_token_loss,
    hf_seq2seq_loss,
    tlens_forward,
    tlens_loss,
    tlens_loss_of_output,
    cross_entropy_loss_of_output,
    mse_loss_of_output,
)
_TAKE_CRITERION: tuple[Callable[..., Any], ...] = (supervised_loss, supervised_loss_of_output, supervised_per_sample_loss)


def check_loss_argument(fn: object, *, name: str, wrap: str) -> None:
    """Raise ``TypeError`` saying what to write when ``fn`` (the argument ``name``) is a criterion
    module or an uncalled helper factory; ``wrap`` is the helper that turns a criterion into it."""
    if isinstance(fn, nn.modules.loss._Loss):
        crit = type(fn).__name__
        raise TypeError(
            f"{name} got the criterion {crit}(), which takes (output, target); pass {wrap}(nn.{crit}()) "
            f"(from hessian_eigenthings.loss_fns), which applies it to model(inputs) and the targets of each batch"
        )
    if any(fn is f for f in _NO_ARGUMENT):
        factory = fn.__name__  # type: ignore[attr-defined]
        raise TypeError(f"{name} got the helper {factory} itself; call it: {name}={factory}()")
    if any(fn is f for f in _TAKE_CRITERION):
        factory = fn.__name__  # type: ignore[attr-defined]
        raise TypeError(f"{name} got the helper {factory} itself; call it with your criterion: {factory}(nn.CrossEntropyLoss())")
