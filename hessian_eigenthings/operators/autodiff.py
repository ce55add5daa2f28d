"""Autodiff numerics every curvature shares: the finite-difference step and its two
evaluation points, the scalar-loss check, and a model call as a function of the
selected parameters (for ``torch.func``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.param_utils import call_with_values

# NOTE [finite-difference step]
# The central difference has truncation error O(h²‖∇³L‖) and rounding error
# O(ε_mach‖∇L‖/h); their sum is smallest near h ~ ε_mach^(1/3). Defaults per
# dtype (f64 6e-6, f32 5e-3, f16 5e-2, bf16 0.2) are that cube root, rounded.
# The step is taken along the unit vector v/‖v‖ so that h is a distance in
# parameter space whatever the scale of v; the norm stays a device tensor.
FD_EPS: dict[torch.dtype, float] = {
    torch.float64: 6e-6,
    torch.float32: 5e-3,
    torch.float16: 5e-2,
    torch.bfloat16: 0.2,
}


def default_fd_eps(dtype: torch.dtype) -> float:
    """Finite-difference step for ``dtype`` (see NOTE [finite-difference step])."""
    if dtype not in FD_EPS:
        raise TypeError(f"finite differences need a floating dtype, got {dtype}")
    return FD_EPS[dtype]


def central_points(
    at: Sequence[torch.Tensor], v: Sequence[torch.Tensor], eps: float
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """``θ ± h·v/‖v‖`` as fresh tensors (the user's are never written) and ``‖v‖ / 2h``, the
    factor of the central difference ``(f(θ + h v̂) − f(θ − h v̂))·‖v‖ / 2h``; a zero ``v``
    gives a zero difference (NOTE [finite-difference step])."""
    with torch.no_grad():
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in v]))
        scale = eps / norm.clamp_min(torch.finfo(norm.dtype).tiny ** 0.5)
        plus = [p + x * scale for p, x in zip(at, v, strict=True)]
        minus = [p - x * scale for p, x in zip(at, v, strict=True)]
    return plus, minus, 0.5 / scale


def scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` as a 0-d tensor with a graph, or an error that says what is wrong with it."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar (mean loss over the batch), got shape {tuple(loss.shape)}"
        )
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on the selected parameters (no autograd graph); check that "
            "loss_fn calls the model and that the parameters require grad"
        )
    return loss.reshape(())


class CallWithModel(nn.Module):
    """``fn(model, batch)`` as a module, so ``torch.func.functional_call`` can swap the model's parameters."""

    def __init__(self, model: nn.Module, fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.fn(self.model, batch)


def selected_function(
    call: nn.Module, names: Sequence[str], state: dict[str, torch.Tensor], batch: Batch
) -> tuple[Callable[..., Any], tuple[torch.Tensor, ...]]:
    """``call(batch)`` (a :class:`CallWithModel`) as a function of the parameters ``names``,
    the other parameters and buffers fixed at ``state``; and the values of ``names``."""
    selected = set(names)
    fixed = {f"model.{n}": t for n, t in state.items() if n not in selected}
    call_names = [f"model.{n}" for n in names]

    def f(*values: torch.Tensor) -> Any:
        full = dict(fixed)
        full.update(zip(call_names, values, strict=True))
        return call_with_values(call, full, (batch,))

    return f, tuple(state[n] for n in names)


def batched_backward(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    retain: bool,
    batched_ok: bool | None,
) -> tuple[list[torch.Tensor | None], bool | None]:
    """The backward of ``outputs`` to ``inputs`` for each of the k rows of ``grad_outputs``
    (one ``(k, *output.shape)`` tensor per output): one batched backward (``is_grads_batched``)
    where it works (``batched_ok``: known to, known not to, or ``None``: try once; torch's
    warning that an op has no batching rule counts as not working), else one backward per row.
    Returns the gradients per input ``(k, *input.shape)`` (``None``: unused) and what is now
    known."""
    k = grad_outputs[0].shape[0]
    if k > 1 and batched_ok is not False:
        first = batched_ok is None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                g = torch.autograd.grad(
                    outputs,
                    inputs,
                    grad_outputs,
                    is_grads_batched=True,
                    retain_graph=retain or first,
                    allow_unused=True,
                )
        except (RuntimeError, NotImplementedError, UserWarning):
            if not first:
                raise
            batched_ok = False
        else:
            return list(g), True
    rows = [
        torch.autograd.grad(
            outputs,
            inputs,
            [u[j] for u in grad_outputs],
            retain_graph=retain or j < k - 1,
            allow_unused=True,
        )
        for j in range(k)
    ]
    return [
        None if rows[0][i] is None else torch.stack([r[i] for r in rows])
        for i in range(len(inputs))
    ], batched_ok
