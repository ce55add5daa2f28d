"""Catch wrong loss arguments and unreadable data when an operator is built, not at its first product.

- A criterion module (``nn.CrossEntropyLoss()``, the 0.x habit) or its class where a function of
  ``(model, batch)`` is expected: it would be called as ``criterion(model, batch)``.
- A helper factory passed without calling it (``hf_lm_loss`` instead of ``hf_lm_loss()``).
- A first batch the supervised helpers cannot read (a dict, a bare tensor), or whose inputs
  have another dtype than the model (:func:`check_first_batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import Batch, iter_tensors
from hessian_eigenthings.loss_fns.huggingface import (
    hf_lm_forward,
    hf_lm_loss,
    hf_lm_loss_of_output,
    hf_lm_per_sequence_loss,
    hf_lm_per_token_loss,
    hf_seq2seq_loss,
)
from hessian_eigenthings.loss_fns.standard import (
    SUPERVISED_READERS,
    BCEWithLogitsOutputLoss,
    CrossEntropyOutputLoss,
    MSEOutputLoss,
    _CriterionOfOutput,
    check_criterion,
    cross_entropy_loss_of_output,
    describe_batch,
    mse_loss_of_output,
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
    unreadable_batch_hint,
)
from hessian_eigenthings.loss_fns.transformer_lens import (
    tlens_forward,
    tlens_loss,
    tlens_loss_of_output,
)

__all__ = ["check_criterion", "check_first_batch", "check_loss_argument"]

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
_TAKE_CRITERION: tuple[Callable[..., Any], ...] = (
    supervised_loss,
    supervised_loss_of_output,
    supervised_per_sample_loss,
)


def check_loss_argument(fn: object, *, name: str, wrap: str) -> None:
    """Raise ``TypeError`` saying what to write when ``fn`` (the argument ``name``) is a criterion
    module or an uncalled helper factory; ``wrap`` is the helper that turns a criterion into it."""
    if isinstance(fn, type) and issubclass(fn, nn.modules.loss._Loss):
        crit = fn.__name__
        raise TypeError(
            f"{name} got the class nn.{crit}; pass {wrap}(nn.{crit}()) (from hessian_eigenthings.loss_fns): "
            "an instance of the criterion, wrapped so that it is applied to model(inputs) and the targets"
        )
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
        raise TypeError(
            f"{name} got the helper {factory} itself; call it with your criterion: {factory}(nn.CrossEntropyLoss())"
        )


# NOTE [first-batch check]
# The supervised helpers of loss_fns.standard know the layout they read, (inputs, targets), and
# that they call model(inputs) on it; a mistake there (a dict batch, data of another dtype than
# the model) otherwise surfaces at the first product as torch's raw error, several frames into a
# product. So an operator reads its first batch once when built (BatchSource.first_batch: no RNG
# drawn, no one-shot iterator consumed) and hands it here. Only what the helpers themselves will do
# is checked: a loss of the user's own may cast or unpack the batch in ways we cannot see, so it
# passes untouched; a model whose parameters have several floating dtypes is not judged either.


def _reader(fn: object) -> tuple[str, bool] | None:
    """``(label, calls model(inputs))`` for the supervised helpers, None for anything else."""
    if isinstance(
        fn, (CrossEntropyOutputLoss, MSEOutputLoss, BCEWithLogitsOutputLoss, _CriterionOfOutput)
    ):
        return type(fn).__name__ if not isinstance(fn, _CriterionOfOutput) else repr(fn), False
    if not callable(fn):
        return None
    try:
        return SUPERVISED_READERS.get(fn)
    except TypeError:  # not weak-referenceable: not one of ours
        return None


_CONVERSION = {
    torch.float64: "double",
    torch.float32: "float",
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
}


def _convert(dtype: torch.dtype, what: str) -> str:
    method = _CONVERSION.get(dtype)
    return f"{what}.{method}()" if method else f"{what}.to({dtype})"


def check_first_batch(model: nn.Module, batch: Batch | None, *fns: object) -> None:
    """Raise ``TypeError`` when the supervised helpers among ``fns`` cannot run on ``batch``.

    ``batch`` is the data's first batch (``BatchSource.first_batch()``; None: nothing to check),
    ``fns`` the loss callables the operator was given (``loss_fn``; ``forward_fn`` and
    ``loss_of_output_fn``; ``per_sample_loss_fn``). Checked, for helpers of
    :mod:`hessian_eigenthings.loss_fns.standard` only (see NOTE [first-batch check]):

    - the batch is ``(inputs, targets)`` (not a dict, a bare tensor or a 1-element list);
    - the floating tensors of ``inputs`` have the dtype of the model's parameters, for helpers
      that call ``model(inputs)``.
    """
    if batch is None:
        return
    readers = [r for r in map(_reader, fns) if r is not None]
    if not readers:
        return
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(
            f"{readers[0][0]} reads batches (inputs, targets); the first batch is {describe_batch(batch)}. "
            + unreadable_batch_hint(batch)
        )
    if not any(calls_model for _, calls_model in readers):
        return
    model_dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(model_dtypes) != 1:
        return
    (model_dtype,) = model_dtypes
    for t in iter_tensors(batch[0]):
        if t.is_floating_point() and t.dtype != model_dtype:
            ours, theirs = (
                str(model_dtype).removeprefix("torch."),
                str(t.dtype).removeprefix("torch."),
            )
            raise TypeError(
                f"model parameters are {ours} but the batch's inputs are {theirs}: convert the data "
                f"({_convert(model_dtype, 'x')}) or the model ({_convert(t.dtype, 'model')})"
            )
