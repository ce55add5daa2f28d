"""Hessian of the mean loss over the data, ``H = ∇²_θ L(θ)``.

``method="autograd"``: reverse-over-reverse. One forward and one backward
with ``create_graph`` build ``g = ∇L``; a second backward of ``⟨g, v⟩``
gives ``H v``. A block of k vectors goes through the second backward at once
(``is_grads_batched``). With graph reuse (NOTE [graph reuse] in ``graph_reuse``) the
first two steps are paid once and each product costs one backward.

``method="finite_difference"``: ``H v ≈ (g(θ + h v̂) − g(θ − h v̂)) ‖v‖ / 2h``
(central difference, error O(h²)), two ordinary forward–backward passes per
vector, no double backward: works with kernels that have none (flash
attention, fused ops) and with sharded models. See NOTE [finite-difference step] in ``autodiff``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from typing_extensions import Unpack

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.loss_fns.checks import check_first_batch, check_loss_argument
from hessian_eigenthings.operators.autodiff import (
    CallWithModel,
    batched_backward,
    central_points,
    default_fd_eps,
    scalar_loss,
    selected_function,
)
from hessian_eigenthings.operators.base import DataCurvatureOperator, DataOptions
from hessian_eigenthings.operators.engines.layers import LayerWalk, LayerWalkRunner
from hessian_eigenthings.operators.engines.runner import unsupported
from hessian_eigenthings.param_utils import call_with_values

LossFn = Callable[[nn.Module, Batch], torch.Tensor]

# NOTE [blocks on the CPU]
# On the CPU a block of k products runs as k backwards through the same graph,
# not as one vmapped backward (`is_grads_batched`): the vmapped one was slower
# per vector on every parity workload measured on one CPU thread (block of 8,
# ms per vector against one product: MLP 50 vs 17, ResNet-18 453 vs 257,
# 4-batch MLP 117 vs 33, reduced GPT-2 381 vs 69; CNN+BatchNorm 14.6 vs 14.3).
# The forward and first backward are still shared by the block. On
# accelerators the vmapped backward is the faster one (GPU: 0.45-0.57x the
# gradient per vector on the MLP and ResNet-18 against 0.8-0.9x for one).


class _GradState(NamedTuple):
    """The first-order graph of one batch: ``∇L`` (``None`` where constant) and what it is taken with respect to."""

    grads: list[torch.Tensor | None]
    inputs: Sequence[torch.Tensor]


class _AtBatch(NamedTuple):
    """The state of a finite-difference product: its batch (the gradients at ``θ ± h·v̂`` are
    taken in the product; nothing is kept across products)."""

    batch: Batch


class HessianOperator(DataCurvatureOperator):
    """Hessian of ``loss_fn(model, batch)`` averaged over the data (weighted by batch size).

    ``HessianOperator(model, dataloader, loss_fn, *, param_filter=None,
    full_dataset=True, num_batches=None, microbatch_size=None,
    microbatch_unsafe=False, method="autograd", fd_eps=None, backend=None)``
    plus the block, graph-reuse, CUDA-graph and engine options of
    :class:`DataCurvatureOperator`. All but ``method`` and ``fd_eps`` travel as one record,
    :class:`~hessian_eigenthings.operators.base.DataOptions` (``**options``).
    """

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        loss_fn: LossFn,
        *,
        method: Literal["autograd", "finite_difference"] = "autograd",
        fd_eps: float | None = None,
        **options: Unpack[DataOptions],
    ) -> None:
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
        check_loss_argument(loss_fn, name="loss_fn", wrap="supervised_loss")
        if method not in ("autograd", "finite_difference"):
            raise ValueError(f"method must be 'autograd' or 'finite_difference', got {method!r}")
        if fd_eps is not None and not fd_eps > 0:
            raise ValueError(f"fd_eps must be positive, got {fd_eps}")
        self.loss_fn = loss_fn
        self.method = method
        # capabilities, before the base builds the engine selector from them: finite
        # differences keep no state and run ordinary gradients
        autograd = method == "autograd"
        self.supports_graph_reuse = self.needs_double_backward = autograd
        self.supports_cuda_graphs = self.supports_functional = autograd
        super().__init__(model, dataloader, **options)
        check_first_batch(model, self.source.first_batch(), loss_fn)
        self.fd_eps = fd_eps if fd_eps is not None else default_fd_eps(self.dtype)
        # is_grads_batched works for this model (None: not tried yet)? See NOTE [blocks on the CPU]
        self._batched_ok: bool | None = False if self.device.type == "cpu" else None
        self._call = CallWithModel(self.model, loss_fn)
        self._call_names = [f"model.{n}" for n in self.layout.names]

    def functional_unsupported_reason(self) -> str:
        return "method='finite_difference' runs ordinary gradients, not a traced product"

    def inconsistency_causes(self) -> list[str]:
        causes = super().inconsistency_causes()
        if self.method == "finite_difference":
            causes.append(
                f"finite differences (fd_eps={self.fd_eps:g}) carry truncation and rounding error of about "
                "fd_eps² and eps/fd_eps relative"
            )
        return causes

    def layer_walk_runner(self, **walk: Any) -> LayerWalkRunner:
        """``engine="layers"``: products one layer at a time (NOTE [layer walk]); ``walk``: more
        arguments of :class:`LayerWalk` (a sharded operator's ``gather`` and ``finish``)."""
        if self.method == "finite_difference":
            raise unsupported("layers", type(self).__name__, f"method={self.method!r}")
        if self.layers is None:  # checked at construction
            raise InternalError("self.layers is not None")
        return LayerWalkRunner(
            LayerWalk(self.model, self.loss_fn, self.layout.names, self.layers, **walk), self.counts
        )

    def functional_product(
        self, state: dict[str, torch.Tensor], batch: Batch, tangent: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``H v`` by forward-over-reverse: ``jvp(grad(loss))`` (see ``operators.engines``)."""
        f, primal = selected_function(self._call, self.layout.names, state, batch)

        def loss(selected: tuple[torch.Tensor, ...]) -> torch.Tensor:
            value = f(*selected)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError("loss_fn must return a scalar (mean loss over the batch)")
            return value.reshape(())

        hv = torch.func.jvp(torch.func.grad(loss), (primal,), (tuple(tangent),))[1]
        return list(hv)

    # -- autograd ---------------------------------------------------------------
    def _prepare(
        self, batch: Batch, params: Sequence[torch.Tensor] | None = None
    ) -> _GradState | _AtBatch:
        """``∇L`` with a graph, with respect to ``params`` (stand-ins for the selected parameters,
        NOTE [CUDA graphs] in ``cuda_graphs``) or the parameters themselves; for finite
        differences only the batch (they keep nothing)."""
        if self.method == "finite_difference":
            return _AtBatch(batch)
        self.num_forwards += 1
        if params is None:
            # a half model's float32 copies, swapped in for the pass (NOTE [half models])
            inputs: Sequence[torch.Tensor] = (
                self.params if self._upcast is None else self._upcast.params
            )
            loss = scalar_loss(self.loss_fn(self.model, batch))
        else:
            inputs = params
            named = dict(zip(self._call_names, params, strict=True))
            loss = scalar_loss(call_with_values(self._call, named, (batch,)))
        grads = torch.autograd.grad(loss, inputs, create_graph=True, allow_unused=True)
        # a gradient without graph is constant in θ: its Hessian rows are zero
        return _GradState([g if g is not None and g.requires_grad else None for g in grads], inputs)

    def _apply(
        self, state: _GradState | _AtBatch, vecs: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]:
        if isinstance(state, _AtBatch):
            return self._differences(state.batch, vecs)
        live = [i for i, g in enumerate(state.grads) if g is not None]
        if not live:
            return [None] * len(self.params)
        grads: list[torch.Tensor] = [g for g in state.grads if g is not None]
        inputs = state.inputs
        k = vecs[0].shape[0]
        if k == 1:
            hv = torch.autograd.grad(
                grads,
                inputs,
                grad_outputs=[vecs[i][0] for i in live],
                retain_graph=retain,
                allow_unused=True,
            )
            return [None if h is None else h.unsqueeze(0) for h in hv]
        hv_rows, self._batched_ok = batched_backward(
            grads, inputs, [vecs[i] for i in live], retain, self._batched_ok
        )
        return hv_rows

    # -- finite differences ---------------------------------------------------
    def _grad_at(self, batch: Batch, at: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        """``∇L`` with the selected parameters replaced by ``at`` (fresh leaves; see NOTE [perturbed copies])."""
        self.num_forwards += 1
        leaves = [t.requires_grad_(True) for t in at]
        named = dict(zip(self._call_names, leaves, strict=True))
        loss = scalar_loss(call_with_values(self._call, named, (batch,)))
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    # NOTE [perturbed copies]
    # Finite differences evaluate the gradient at θ ± h·v̂ on copies of the
    # selected parameters swapped in through functional_call; the user's
    # parameters are never written, so their version counters stay put and a
    # graph the user built before the product (a pending loss.backward()) stays
    # valid. Tied weights follow (functional_call ties them).
    def _differences(self, batch: Batch, vecs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``H v`` by central differences of the gradient (NOTE [perturbed copies])."""
        at = self.params if self._upcast is None else self._upcast.params  # NOTE [half models]
        base = [p.detach() for p in at]
        out = [torch.empty_like(v) for v in vecs]
        # the padding lookups read the rows of θ, not of θ ± h·v̂ (NOTE [padding rows])
        with self.guard.padding.frozen():
            self._central_differences(batch, vecs, base, out)
        return out

    def _central_differences(
        self,
        batch: Batch,
        vecs: list[torch.Tensor],
        base: list[torch.Tensor],
        out: list[torch.Tensor],
    ) -> None:
        for j in range(vecs[0].shape[0]):
            plus, minus, inv = central_points(base, [v[j] for v in vecs], self.fd_eps)
            g_plus = self._grad_at(batch, plus)
            g_minus = self._grad_at(batch, minus)
            with torch.no_grad():
                for o, gp, gm in zip(out, g_plus, g_minus, strict=True):
                    if gp is None or gm is None:
                        o[j].zero_()
                    else:
                        torch.mul(gp - gm, inv, out=o[j])


#: the 1.0 alpha's name for the ``method`` values
HvpMethod = Literal["autograd", "finite_difference"]
