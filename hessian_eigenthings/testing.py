"""Dense oracles for tests: exact curvature matrices of small models in any dtype.

Built with ``torch.func`` on a functional copy of the model, independent of
the operators' code paths. Cost O(n²) memory: for models of a few thousand
parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from hessian_eigenthings._torch_compat import math_sdpa
from hessian_eigenthings.batching import Batch, batch_size, batchnorm_modules


def _pairs(
    named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``select_parameters``'s dict (or of a list of pairs)."""
    return list(named.items()) if isinstance(named, Mapping) else list(named)


def _each_slot(model: nn.Module, by_id: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Substitutes keyed by attribute slot, each slot once: a tied tensor (embedding = LM head)
    is replaced in every slot that holds it, and a module registered under two names
    (``nn.Sequential(blk, blk)``) is swapped once, so restoring it puts the parameters back."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in model.named_modules():  # each module object once
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and id(t) in by_id:
                out[f"{prefix}.{attr}" if prefix else attr] = by_id[id(t)]
    return out


def _flat_fn(
    model: nn.Module,
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    fn: Callable[[nn.Module, Batch], torch.Tensor],
    batch: Batch,
) -> Callable[[torch.Tensor], torch.Tensor]:
    sizes = [s.numel() for s in shapes]
    current = dict(model.named_parameters(remove_duplicate=False))
    ids = [id(current[n]) for n in names]

    def f(theta: torch.Tensor) -> torch.Tensor:
        parts = torch.split(theta, sizes)
        by_id = {i: p.view(s) for i, p, s in zip(ids, parts, shapes, strict=True)}
        # fresh buffer copies: BatchNorm in training mode updates its statistics in place
        by_id.update({id(b): b.clone() for b in model.buffers()})

        class _Call(nn.Module):
            def forward(self_inner) -> torch.Tensor:
                return fn(model, batch)

        with torch.nn.utils.stateless._reparametrize_module(model, _each_slot(model, by_id)):
            return _Call()()

    return f


def dense_hessian(
    model: nn.Module,
    batches: Iterable[Batch],
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """``Σ bᵢ ∇²L_i / Σ bᵢ`` over ``batches`` as a dense ``(n, n)`` matrix."""
    named_params = _pairs(named_params)
    names = [n for n, _ in named_params]
    shapes = [p.shape for _, p in named_params]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named_params])
    total = 0
    acc = torch.zeros(theta.numel(), theta.numel(), dtype=theta.dtype)
    for batch in batches:
        b = batch_size(batch)
        # reverse-over-reverse under math attention: flash SDPA has no forward-mode or double backward
        # row by row when BatchNorm trains: vmap mishandles its in-place statistics updates
        chunk = 1 if batchnorm_modules(model) else None
        f = _flat_fn(model, names, shapes, loss_fn, batch)
        with math_sdpa():
            H = torch.func.jacrev(torch.func.jacrev(f, chunk_size=chunk), chunk_size=chunk)(theta)
        acc += b * H.detach().to(acc.device)
        total += b
    return acc / total


def dense_jacobian(
    model: nn.Module,
    batch: Batch,
    fn: Callable[[nn.Module, Batch], torch.Tensor],
    named_params: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> torch.Tensor:
    """Jacobian of ``fn(model, batch)`` (flattened) w.r.t. the flat parameters: ``(m, n)``."""
    named_params = _pairs(named_params)
    names = [n for n, _ in named_params]
    shapes = [p.shape for _, p in named_params]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named_params])
    f = _flat_fn(model, names, shapes, fn, batch)
    with math_sdpa():
        return torch.func.jacrev(lambda t: f(t).reshape(-1))(theta).detach()
