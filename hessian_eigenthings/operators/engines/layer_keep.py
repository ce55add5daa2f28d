"""Layer graphs kept from the forward walk to the backward walk (NOTE [kept layer graphs]).

:class:`Keep` counts the room one Hessian product of the layer walk has for kept graphs;
:func:`keep_room` sizes it from the device's free memory and what earlier products measured;
:class:`DifferentiableNorms` runs ``F.layer_norm`` as a formula whose forward-mode derivative
differentiates in reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hessian_eigenthings import _torch_compat

# NOTE [kept layer graphs]
# The backward walk of NOTE [layer walk] runs each layer's forward with
# tangents again: in forward-costs F of the layer (a matmul's tangent is two
# matmuls), the forward walk takes 3F and the backward walk 9F (3F forward
# again, then the pullback and its tangent, 6F), 12F against a training
# step's 3F. Where memory allows, the forward walk instead records the
# layer's jvp under vjp (reverse over forward), φ(x, θ, ẋ) = (y, ẏ) with
# ẏ = J_x ẋ + J_θ v, and the backward walk pulls the pair (ȧᵢ₊₁, aᵢ₊₁) back
# through it: ∂ₓ is ȧᵢ, ∂_θ is ġᵢ, and ∂_ẋ is J_xᵀ aᵢ₊₁ = aᵢ (ẏ is linear in
# ẋ). Mixed second derivatives are symmetric, so this is the jvp of the
# pullback to rounding, at 9F instead of 12F and without gathering the layer
# again; the price is the jvp's graph (about twice a training step's
# activations of the layer) held from the forward walk to the layer's turn in
# the backward walk. Layers are kept in order while their graphs fit
# `keep_bytes`. By default, on CUDA, that is what is free when the product
# starts (free to the driver plus the allocator's unused cache) less the walk's
# own working set and a tenth of the device: the first product of each batch
# signature keeps nothing and reads its working set off the allocator's peak
# (an upper bound when an earlier peak of the process was higher: then less is
# kept); the size of a graph is measured as the allocation grows. Both are
# kept per batch signature, since both grow with the batch (an uneven last
# batch is measured on its own). On the CPU nothing is kept.
# Not every forward-mode formula of torch can be differentiated in reverse:
# layer_norm's reads its mean and inverse deviation as constants (they are
# non-differentiable outputs of the native op), so reverse over forward drops
# terms (0.7 relative error on one call, torch 2.13). While a kept graph is
# recorded, F.layer_norm runs as its composite formula. Against formulas not
# known, the first kept layer of a walk is also computed the recomputing way
# once and compared (to the square root of the dtype's epsilon); if they
# differ, keeping is off for the walk (`keep_refused` says why).

#: by default kept layer graphs leave this fraction of the device free (NOTE [kept layer graphs])
WALK_FREE_FRACTION = 0.1


def composite_layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` written out in differentiable operations."""
    dims = tuple(range(-len(normalized_shape), 0))
    centred = x - x.mean(dims, keepdim=True)
    out = centred * torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out + bias if bias is not None else out


class DifferentiableNorms(torch.overrides.TorchFunctionMode):
    """``F.layer_norm`` as its composite formula, whose forward-mode derivative differentiates in
    reverse (NOTE [kept layer graphs])."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.nn.functional.layer_norm:
            return composite_layer_norm(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class Keep:
    """The room left for kept layer graphs in one product (NOTE [kept layer graphs]): a layer is
    kept while the graphs kept so far plus one more of the last measured size fit ``room``."""

    def __init__(
        self, room: int, device: torch.device, size: int | None, count: int | None = None
    ) -> None:
        self.room = room
        self.limit = count  # the number of layers to keep, when agreed beforehand
        self.device = device
        self.size = size  # one graph's bytes, once measured (else the first is admitted unseen)
        self.used = 0
        self.count = 0

    def admits(self) -> bool:
        if self.limit is not None:
            return self.count < self.limit
        if self.room <= 0:
            return False
        return self.size is None or self.used + self.size <= self.room

    def mark(self) -> int:
        return _torch_compat.cuda_allocated(self.device) if self.device.type == "cuda" else 0

    def grew(self, mark: int) -> None:
        self.count += 1
        if self.device.type == "cuda":
            self.size = max(0, _torch_compat.cuda_allocated(self.device) - mark)
            self.used += self.size
        else:  # no allocator to read: the room counts layers (keep_bytes=k keeps k of them)
            self.size = 1
            self.used += 1


def keep_room(
    keep_bytes: int | None,
    like: torch.Tensor,
    working: int | None,
    size: int | None,
    *,
    layers: int,
    agree: Callable[[float, str], float] | None,
) -> Keep:
    """The room for one product's kept layer graphs (NOTE [kept layer graphs]): ``keep_bytes``
    (``None``: on CUDA, what is free beyond the ``working`` set measured on this batch signature
    and a tenth of the device), given one graph's measured ``size``; ``agree``: ranks that walk
    together keep as many of their ``layers`` as fit every rank."""
    room = keep_bytes
    if room is None:
        room = 0
        if like.device.type == "cuda" and working is not None:
            free, total = torch.cuda.mem_get_info(like.device)
            unused = _torch_compat.cuda_reserved(like.device) - _torch_compat.cuda_allocated(
                like.device
            )
            room = max(0, free + unused - working - int(WALK_FREE_FRACTION * total))
    count = None
    if agree is not None:
        # ranks keep the same layers, so that their gathers pair up: as many as fit every rank
        # (none on the first product, one to measure on the next)
        fits = (1 if room > 0 else 0) if size is None else room // max(size, 1)
        count = int(agree(float(min(fits, layers)), "min"))
    return Keep(room, like.device, size, count)
