"""Per-example gradients over a fixed set of parameters, as rows ``(B, n)`` of the flat layout.

``torch.func.vmap(torch.func.grad(L))`` over the examples of a batch, with the selected
parameters passed through ``torch.func.functional_call`` (the others, and the buffers, are the
model's own, read as constants): one batched backward per batch. A model that vmap cannot run
(data-dependent control flow, ``.item()``, in-place writes into captured tensors, some custom
kernels) falls back, once and for good, to a loop with one backward per example, which gives
the same numbers.

The model is left as it was: no parameter is written, ``.grad`` is never touched (the gradients
are returned, not accumulated), nor are ``requires_grad`` flags or train/eval modes. Tied
parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are passed under their
first name and ``functional_call`` ties the other uses to it, so a tied parameter's gradient
sums over every use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import Batch, batch_size, map_tensors
from hessian_eigenthings.param_utils import ParamLayout

__all__ = ["PerExampleGradients"]

PerExampleLoss = Callable[[nn.Module, Batch], torch.Tensor]


def _as_plain(batch: Batch) -> Batch:
    """A mapping batch (``BatchEncoding``) as a dict: vmap walks dicts, tuples and lists."""
    if hasattr(batch, "keys") and hasattr(batch, "__getitem__") and not isinstance(batch, dict):
        return {k: batch[k] for k in batch.keys()}
    return batch


class PerExampleGradients:
    """``gradients(batch) -> (B, n)``: the gradient of ``loss(model, batch)[i]`` with respect to
    the parameters of ``layout`` (by name, in its order), for each example ``i``."""

    def __init__(self, model: nn.Module, layout: ParamLayout, loss: PerExampleLoss) -> None:
        self.model = model
        self.layout = layout
        self.loss = loss
        params = dict(model.named_parameters())
        missing = [n for n in layout.names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameters named {missing[:3]}")
        self._params = {n: params[n] for n in layout.names}
        #: whether vmap ran this model; None until the first batch says so
        self.vmap_works: bool | None = None

    def __call__(self, batch: Batch) -> torch.Tensor:
        batch = _as_plain(batch)
        B = batch_size(batch)
        if B == 0:
            return torch.zeros(
                0, self.layout.size, dtype=self.layout.dtype, device=self.layout.device
            )
        if self.vmap_works is not False:
            try:
                rows = self._vmapped(batch)
            except Exception:
                if self.vmap_works:  # it ran before: this failure is the batch's own
                    raise
                self.vmap_works = False
            else:
                self.vmap_works = True
                return rows
        return self._looped(batch, B)

    def _flat(self, grads: dict[str, torch.Tensor], B: int) -> torch.Tensor:
        return torch.cat([grads[n].reshape(B, -1) for n in self.layout.names], dim=1)

    def _vmapped(self, batch: Batch) -> torch.Tensor:
        model, loss = self.model, self.loss

        def example_loss(params: dict[str, torch.Tensor], example: Batch) -> torch.Tensor:
            single = map_tensors(example, lambda t: t.unsqueeze(0))
            return _call_with(model, params, lambda: loss(model, single)).reshape(())

        detached = {n: p.detach() for n, p in self._params.items()}
        with torch.no_grad():  # the unselected parameters: constants (torch.func.grad ignores it)
            grads = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0))(
                detached, batch
            )
        return self._flat(grads, batch_size(batch))

    def _looped(self, batch: Batch, B: int) -> torch.Tensor:
        out = torch.empty(B, self.layout.size, dtype=self.layout.dtype, device=self.layout.device)
        for i in range(B):
            single = map_tensors(batch, _row(i))
            leaves = {n: p.detach().requires_grad_(True) for n, p in self._params.items()}

            def run(s: Batch = single) -> torch.Tensor:
                return self.loss(self.model, s)

            with torch.enable_grad():
                value = _call_with(self.model, leaves, run)
                grads = torch.autograd.grad(
                    value.reshape(()), list(leaves.values()), allow_unused=True
                )
            out[i] = torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for g, p in zip(grads, leaves.values(), strict=True)
                ]
            ).to(out.dtype)
        return out


def _row(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def row(t: torch.Tensor) -> torch.Tensor:
        return t[i : i + 1]

    return row


def _call_with(
    model: nn.Module, params: dict[str, torch.Tensor], run: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``run()`` with the module's parameters ``params`` swapped in for the call (the loss calls
    the model itself: ``functional_call`` reaches its forward through a one-off wrapper)."""
    wrapper = _Swap(model, run)
    named = {f"model.{n}": t for n, t in params.items()}
    result: Any = torch.func.functional_call(wrapper, named, (), {}, strict=False)
    return result


class _Swap(nn.Module):
    """Holds the model as a submodule so that ``functional_call`` swaps its parameters while
    ``run`` (which calls the model through the user's loss) executes."""

    def __init__(self, model: nn.Module, run: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._run = run

    def forward(self) -> torch.Tensor:
        return self._run()
