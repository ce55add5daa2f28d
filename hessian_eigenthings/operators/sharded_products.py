"""The products of sharded ranks (``operators.sharded``): per chunk, products on this rank's
shards already summed over the ranks, and the ranks' total weight.

- :class:`ShardedWalk`: the sharded layer walk (NOTE [sharded layer walk]), exact;
- :class:`ShardedFunctional`: any curvature's ``functional_product`` on the whole model, gathered
  on every rank for each chunk (NOTE [gathered functional product]), exact;
- :class:`ShardedDifferences`: central differences ``H v ≈ (g(θ + h v̂) − g(θ − h v̂))·‖v‖ / 2h``
  with ``g`` from ordinary FSDP forward–backward passes, whose reduce-scatter hands each rank
  its shard of the data-averaged gradient (NOTE [sharded vector layout] on the weighting).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.operators.autodiff import scalar_loss
from hessian_eigenthings.operators.engines.layers import LayerWalkRunner
from hessian_eigenthings.operators.engines.runner import ProductCounts
from hessian_eigenthings.operators.engines.tracing import PureProduct
from hessian_eigenthings.operators.hessian import LossFn
from hessian_eigenthings.operators.model_guard import ModelGuard
from hessian_eigenthings.operators.precision import upcast_batch
from hessian_eigenthings.operators.ranks import RankGroup, is_dtensor, local_shard
from hessian_eigenthings.operators.sharded_walk import ShardGather, chunk_rows

__all__ = ["ShardedDifferences", "ShardedFunctional", "ShardedProduct", "ShardedWalk"]


class ShardedProduct:
    """How a sharded operator's chunk products run: ``scope(V)`` around a pass, then per chunk
    ``(products on this rank's shards, the ranks' total weight)``."""

    def scope(self, V: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __call__(
        self, chunk: Batch, weight: float, vecs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], float]:
        raise NotImplementedError


class ShardedWalk(ShardedProduct):
    """The exact product of the ranks' chunks by the sharded layer walk (NOTE [sharded layer
    walk]); the ranks agree after each one's forward (a failure then raises on every rank)."""

    def __init__(self, walk: LayerWalkRunner, shards: ShardGather, agreement: RankGroup) -> None:
        self.walk, self.shards, self.agreement = walk, shards, agreement

    def __call__(
        self, chunk: Batch, weight: float, vecs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], float]:
        failure: BaseException | None = None
        state = None
        dtype = self.shards.dtype
        try:
            self.shards.reshard()
            if dtype is None:
                state = self.walk.prepare(chunk)  # an ordinary FSDP forward, without a graph
            else:
                # NOTE [recording in the product's dtype]: the layers' arguments in float32 too
                with self.shards.recording():
                    state = self.walk.prepare(upcast_batch(chunk, dtype))
        except Exception as exc:
            failure = exc
        total = float(self.agreement.agree(failure, weight, what="a product")[:, 0].sum())
        if state is None:
            raise InternalError("state is not None")
        with self.shards.walking(weight / total):
            return [t for t in self.walk.apply(state, vecs, False)], total  # type: ignore[misc]


# NOTE [gathered functional product]
# A curvature that writes its per-batch product as a pure function of the parameters and
# buffers by name, the batch and one direction (``functional_product``, what the traced engines
# run) needs nothing of the model's sharding: on whole tensors it is the single-process product.
# So with engine="functional" each rank, per chunk, gathers every parameter of the model and
# its shards of the k directions whole in one all-gather (``ShardGather``, FSDP's forward hooks
# set aside), runs the product once per direction on its own batch, and hands back its blocks
# scaled by b_r / B (B: the chunk's total weight over the ranks) in one reduce-scatter, which
# sums them over the ranks and leaves each rank its rows: the product of the union of the
# ranks' chunks, each chunk of each rank a batch of its own (as on one process). The ranks
# agree after the batch is read and again after the products, before the reduce-scatter, so a
# failure raises on every rank instead of leaving the others in a collective. Memory per rank:
# the whole model and k whole directions and products (the layer walk holds one block whole).
# Communication per chunk: one all-gather of the model and the k directions, one
# reduce-scatter of the k products, two agreements. The product runs eagerly (not traced).


class ShardedFunctional(ShardedProduct):
    """A curvature's ``product`` (its ``functional_product``) on the whole model, gathered on
    every rank per chunk (NOTE [gathered functional product]); ``batch_of``: the batch the
    product receives (the curvature's ``_engine_batch``); ``names``: the selected parameters."""

    def __init__(
        self,
        product: PureProduct,
        batch_of: Callable[[Batch], Batch],
        names: Sequence[str],
        shards: ShardGather,
        agreement: RankGroup,
        counts: ProductCounts,
    ) -> None:
        self.product, self.batch_of, self.names = product, batch_of, list(names)
        self.shards, self.agreement, self.counts = shards, agreement, counts

    def __call__(
        self, chunk: Batch, weight: float, vecs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], float]:
        _torch_compat.load_forward_ad_decompositions()  # a product may run forward mode
        failure: BaseException | None = None
        batch = None
        try:
            if self.shards.dtype is not None:  # a half model's inputs (NOTE [half models])
                chunk = upcast_batch(chunk, self.shards.dtype)
            batch = self.batch_of(chunk)  # a sampled curvature's draw key travels beside it
        except Exception as exc:
            failure = exc
        total = float(self.agreement.agree(failure, weight, what="a product")[:, 0].sum())
        model, k, m = self.shards.model, vecs[0].shape[0], len(self.names)
        with self.shards.walking(weight / total):
            every = [n for n, _ in model.named_parameters()]
            items: list[tuple[str, torch.Tensor | None]] = [(n, None) for n in every]
            items += [(n, v[j]) for j in range(k) for n, v in zip(self.names, vecs, strict=True)]
            whole = self.shards.gather(items)
            state = dict(zip(every, whole, strict=False))
            # the walking scope put a half model's buffers in float32 (NOTE [half models])
            state.update({n: b.detach() for n, b in model.named_buffers()})
            tangents = whole[len(every) :]
            rows: list[Sequence[torch.Tensor]] = []
            try:
                for j in range(k):
                    self.counts.forwards += 1
                    rows.append(self.product(state, batch, tangents[j * m : (j + 1) * m]))
            except Exception as exc:
                failure = exc
            self.agreement.agree(failure, weight, what="a product")
            del state, tangents, whole
            mine = self.shards.finish(
                [(n, row[i].detach()) for row in rows for i, n in enumerate(self.names)]
            )
        out = [torch.stack(mine[i::m]) for i in range(m)]
        return out, total


class ShardedDifferences(ShardedProduct):
    """Central differences on sharded parameters (the module docstring); NOTE [sharded vector
    layout] on the weighting."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        params: list[torch.Tensor],
        guard: ModelGuard,
        counts: ProductCounts,
        fd_eps: float,
        fsdp_cls: type,
        agreement: RankGroup,
    ) -> None:
        self.model, self.loss_fn, self.params, self.guard = model, loss_fn, params, guard
        self.counts, self.fd_eps, self.fsdp_cls, self.agreement = (
            counts,
            fd_eps,
            fsdp_cls,
            agreement,
        )
        self._scales: torch.Tensor | None = None

    @contextlib.contextmanager
    def scope(self, V: torch.Tensor) -> Iterator[None]:
        # the step h·v/‖v‖ needs the norm of the whole vector: one all-reduce of k numbers
        sq = torch.linalg.vector_norm(V, dim=1).square()
        dist.all_reduce(sq, group=self.agreement.group)
        self._scales = self.fd_eps / sq.sqrt().clamp_min(torch.finfo(V.dtype).tiny ** 0.5)
        user_grads = [p.grad for p in self.params]
        try:
            # the padding lookups read the rows of θ, not of θ ± h·v̂ (NOTE [padding rows])
            with self.guard.padding.frozen(self._padding_rows()):
                yield
        finally:
            self._scales = None
            for p, g in zip(self.params, user_grads, strict=True):
                p.grad = g

    def _padding_rows(self) -> dict[nn.Module, torch.Tensor]:
        """Each padding embedding's padding row, whole on every rank: FSDP2 gives each rank a
        run of a weight's rows (``chunk_rows``), so the row is copied out by its owner and summed over
        the ranks (one all-reduce of the rows, once per pass; none without such embeddings)."""
        hooks = self.guard.padding.hooks
        if not hooks:
            return {}
        world, rank = self.agreement.world_size, self.agreement.rank
        rows: dict[nn.Module, torch.Tensor] = {}
        for h in hooks:
            weight, pad = h.module.weight.detach(), int(h.module.padding_idx or 0)
            local = local_shard(weight)
            row = torch.zeros(weight.shape[1:], dtype=local.dtype, device=local.device)
            if not is_dtensor(weight):
                row.copy_(weight[pad])
            else:
                sizes = chunk_rows(weight.shape[0], world)  # FSDP2's split of dim 0
                start = sum(sizes[:rank])
                if start <= pad < start + sizes[rank]:
                    row.copy_(local[pad - start])
                dist.all_reduce(row, group=self.agreement.group)
            rows[h.module] = row
        return rows

    def __call__(
        self, chunk: Batch, weight: float, vecs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], float]:
        """Central differences on one chunk; the product over the union of the ranks' chunks
        and their total weight (``weight``: this chunk's, see ``_weight``)."""
        if self._scales is None:
            raise InternalError("self._scales is not None")
        shards = [local_shard(p) for p in self.params]
        saved = [s.detach().clone() for s in shards]
        out = [torch.empty_like(v) for v in vecs]
        total = 0.0
        try:
            for j in range(vecs[0].shape[0]):
                scale = self._scales[j]
                self._set_shards(shards, saved, [v[j] for v in vecs], scale)
                g_plus, total = self._global_grad(chunk, weight)
                self._set_shards(shards, saved, [v[j] for v in vecs], -scale)
                g_minus, _ = self._global_grad(chunk, weight)
                inv = 0.5 / scale
                with torch.no_grad():
                    for o, gp, gm in zip(out, g_plus, g_minus, strict=True):
                        if gp is None or gm is None:
                            o[j].zero_()
                        else:
                            torch.mul(gp - gm, inv, out=o[j])
        finally:
            with torch.no_grad():
                for s, x in zip(shards, saved, strict=True):
                    s.copy_(x)
        return out, total

    def _set_shards(
        self,
        shards: list[torch.Tensor],
        saved: list[torch.Tensor],
        v: list[torch.Tensor],
        scale: torch.Tensor,
    ) -> None:
        # An unsharded copy left from an earlier forward (FSDP keeps the root's
        # after forward) would hide the perturbation: reshard first, so the
        # next forward all-gathers the perturbed shards.
        for m in self.model.modules():
            if isinstance(m, self.fsdp_cls):
                m.reshard()  # type: ignore[operator]
        with torch.no_grad():
            for s, x, vi in zip(shards, saved, v, strict=True):
                s.copy_(vi).mul_(scale).add_(x)

    def _global_grad(self, chunk: Batch, b: float) -> tuple[list[torch.Tensor | None], float]:
        """This rank's shard of the ``b``-weighted gradient over the ranks' chunks, and
        the chunks' total weight. See NOTE [sharded vector layout] on the weighting."""
        self.counts.forwards += 1
        failure: BaseException | None = None
        loss: torch.Tensor | None = None
        try:
            loss = scalar_loss(self.loss_fn(self.model, chunk))
        except Exception as exc:
            failure = exc
        # agree before the backward: its reduce-scatters would wait forever for a failed rank
        total = float(self.agreement.agree(failure, b, what="a product")[:, 0].sum())
        if loss is None:
            raise InternalError("loss is not None")
        for p in self.params:
            p.grad = None
        (loss * (b * self.world_size / total)).backward()
        grads = [None if p.grad is None else local_shard(p.grad) for p in self.params]
        for p in self.params:
            p.grad = None
        return grads, total

    @property
    def world_size(self) -> int:
        return self.agreement.world_size
