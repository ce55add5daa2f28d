"""A test-only curvature: one module plus one registry row (issue 16, DESIGN §6).

``G = Σ_b n_b g_b g_bᵀ / Σ_b n_b`` with ``g_b`` the gradient of batch ``b``'s
mean loss: the batch-gradient outer product (positive semidefinite, rank at most
the number of batches). Nothing in the package knows it; it is written the way
a user adds a curvature: a :class:`DataCurvatureOperator` subclass writing only
its per-batch product (``_prepare`` keeps the gradient, ``_apply`` multiplies a
block by ``g gᵀ``, ``functional_product`` says the same as a pure function for
the traced engines) and one :class:`Curvature` row for :func:`register`. The
base class does the data loop, batch weighting, blocks and the model guard.

Cost per product and batch: one forward and backward (kept across products
with graph reuse), then two inner products per vector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators import DataCurvatureOperator
from hessian_eigenthings.operators.builders import build_from_loss
from hessian_eigenthings.operators.registry import Curvature, MemoryFactors

LossFn = Callable[[nn.Module, Batch], torch.Tensor]


class _LossOfModel(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``torch.func.functional_call`` can swap the
    model's parameters (their names gain the prefix ``model.``)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


class BatchGradientOuterProduct(DataCurvatureOperator):
    """``Σ_b n_b g_b g_bᵀ / Σ_b n_b`` over the batches of the data (``g_b``: batch ``b``'s
    mean-loss gradient). ``loss_fn(model, batch) -> scalar`` as for the Hessian."""

    # the state is a detached gradient: _apply can run on it any number of times
    supports_graph_reuse = True
    needs_double_backward = False
    supports_functional = True

    def __init__(
        self, model: nn.Module, dataloader: Iterable[Batch], loss_fn: LossFn, **options: Any
    ) -> None:
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
        super().__init__(model, dataloader, **options)
        self.loss_fn = loss_fn
        # a plain attribute, not a submodule of anything: the operator is not an nn.Module
        self._loss_module = _LossOfModel(model, loss_fn)

    def _prepare(self, batch: Batch) -> list[torch.Tensor]:
        self.num_forwards += 1
        loss = self.loss_fn(self.model, batch)
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        return [
            torch.zeros_like(p) if g is None else g.detach()
            for g, p in zip(grads, self.params, strict=True)
        ]

    def _apply(
        self, state: list[torch.Tensor], vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor]:
        k = vecs[0].shape[0]
        # <g, v_j> for the k vectors of the block, then g scaled by each
        dots = sum(
            (v.reshape(k, -1) * g.reshape(1, -1)).sum(dim=1)
            for v, g in zip(vecs, state, strict=True)
        )
        assert isinstance(dots, torch.Tensor)
        return [dots.reshape(k, *([1] * g.dim())) * g for g in state]

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        names = self.layout.names
        selected = set(names)
        fixed = {f"model.{n}": t for n, t in state.items() if n not in selected}

        def loss(selected: tuple[torch.Tensor, ...]) -> torch.Tensor:
            values = {**fixed, **{f"model.{n}": t for n, t in zip(names, selected, strict=True)}}
            return torch.func.functional_call(self._loss_module, values, (batch,))

        g = torch.func.grad(loss)(tuple(state[n] for n in names))
        dot = sum((gi * ti).sum() for gi, ti in zip(g, tangent, strict=True))
        return [gi * dot for gi in g]


# NOTE [toy memory factors]: the forward keeps A until the backward frees it; the product
# itself is inner products (no activations per vector); the kept gradient is one vector of
# size n besides the block's input and output.
ROW = Curvature(
    name="batch_gradient_outer",
    operator=BatchGradientOuterProduct,
    title="batch-gradient outer product",
    description="Σ n_b g_b g_bᵀ / N over the batches' mean-loss gradients (a test-only toy)",
    build=build_from_loss,
    memory=(
        MemoryFactors(first_pass=1.0, per_vector=0.0, extra_vectors=1, label="batch gradients"),
    ),
)
