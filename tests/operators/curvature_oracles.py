"""Dense float64 oracles for the GGN and the empirical Fisher (reverse-mode ``torch.func``).

Tied weights are handled (``functional_call`` ties them), and modules in
training mode get private buffer copies, as in the operators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from hessian_eigenthings._torch_compat import math_sdpa
from hessian_eigenthings.batching import Batch, batch_size


class _Call(nn.Module):
    def __init__(self, model: nn.Module, fn: Callable[[nn.Module, Batch], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.fn(self.model, batch)


def jacobian(
    model: nn.Module,
    batch: Batch,
    fn: Callable[[nn.Module, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """``∂ fn(model, batch) / ∂θ`` as ``(m, n)``: output flattened, parameters flat."""
    if isinstance(named_params, Mapping):  # select_parameters' dict
        named_params = list(named_params.items())
    names = [f"model.{n}" for n, _ in named_params]
    shapes = [p.shape for _, p in named_params]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named_params])
    call = _Call(model, fn)

    def f(t: torch.Tensor) -> torch.Tensor:
        parts = torch.split(t, [s.numel() for s in shapes])
        params = {n: p.view(s) for n, p, s in zip(names, parts, shapes, strict=True)}
        params.update({f"model.{n}": b.clone() for n, b in model.named_buffers()})
        return torch.func.functional_call(call, params, (batch,)).reshape(-1)

    with math_sdpa():
        return torch.func.jacrev(f)(theta).detach()


def dense_ggn(
    model: nn.Module,
    batches: Iterable[Batch],
    forward_fn: Callable[[nn.Module, Batch], torch.Tensor],
    loss_of_output: Callable[[torch.Tensor, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """``Σ bᵢ Jᵢᵀ H_i Jᵢ / Σ bᵢ`` with ``H_i`` the dense Hessian of the loss at the output."""
    acc: torch.Tensor | None = None
    total = 0
    for batch in batches:
        J = jacobian(model, batch, forward_fn, named_params)
        with torch.no_grad():
            out = forward_fn(model, batch)
        # reverse over reverse: independent of the operator's forward mode
        H = torch.func.jacrev(torch.func.jacrev(lambda o, b=batch: loss_of_output(o, b)))(
            out.detach()
        )
        H = H.reshape(out.numel(), out.numel())
        b = batch_size(batch)
        term = b * (J.T @ H @ J)
        acc = term if acc is None else acc + term
        total += b
    assert acc is not None
    return acc / total


def dense_empirical_fisher(
    model: nn.Module,
    batches: Iterable[Batch],
    per_sample_loss: Callable[[nn.Module, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """``(1/N) Σᵢ gᵢ gᵢᵀ`` from the dense per-sample gradients ``gᵢ`` (rows of the Jacobian)."""
    grads = [jacobian(model, batch, per_sample_loss, named_params) for batch in batches]
    G = torch.cat(grads)  # (N, n)
    return G.T @ G / G.shape[0]
