"""Curvature products of a model sharded with FSDP2: sharded parameters, sharded vectors.

:class:`Sharded` ranks span the FSDP mesh; an operator given them runs the ordinary data loop,
and its ranks run the chunks (every rank the same number, agreed before each) and their
products, which arrive reduced onto each rank's shards. Vectors are sharded like the parameters
(NOTE [sharded vector layout]); ``op.backend`` is a :class:`DistributedBackend`. Two sharded
products:

- the sharded layer walk (``engine="layers"`` with ``layers=``, NOTE [sharded layer walk]): exact;
- central differences ``H v ≈ (g(θ + h v̂) − g(θ − h v̂))·‖v‖ / 2h`` with ``g`` from ordinary
  FSDP forward–backward passes: FSDP's reduce-scatter hands each rank its shard of the
  data-averaged gradient, so the product arrives sharded and already reduced. Cost per vector
  and chunk: two FSDP forward–backward passes (their all-gathers and reduce-scatters) and two
  status agreements of ``2·W`` numbers; per product one all-reduce of the ``k`` vector norms and
  one status agreement per chunk. Autograd (double backward) is refused: FSDP2 all-gathers
  parameters outside autograd, so no graph links the sharded parameters to the loss.

Any curvature that writes ``functional_product`` (one the package does not know too) runs on
sharded ranks with ``engine="functional"``: its pure product on the whole model, gathered on
every rank for each chunk (NOTE [gathered functional product] in ``sharded_products``): exact,
at the memory of the whole model and ``k`` whole directions per rank.

The ``FSDP*`` classes are constructors that build the ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import deprecation
import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings._warnings import user_stacklevel
from hessian_eigenthings.batching import Batch
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.linalg_distributed import DistributedBackend
from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.cuda_graphs import Product
from hessian_eigenthings.operators.fisher import EmpiricalFisherOperator
from hessian_eigenthings.operators.ggn import GGNOperator
from hessian_eigenthings.operators.hessian import HessianOperator, LossFn
from hessian_eigenthings.operators.ranks import (
    Ranks,
    Replicated,
    first_device,
    is_dtensor,
    layout_signature,
    local_shard,
)
from hessian_eigenthings.operators.sharded_products import (
    ShardedDifferences,
    ShardedFunctional,
    ShardedProduct,
    ShardedWalk,
)
from hessian_eigenthings.operators.sharded_walk import ShardGather, check_every_parameter
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout

__all__ = [
    "FSDPEmpiricalFisherOperator",
    "FSDPGGNOperator",
    "FSDPHessianOperator",
    "Sharded",
    "ShardedMixin",
]

# NOTE [sharded vector layout]
# With FSDP2 each parameter p is a DTensor sharded on dim 0; rank r holds
# p.to_local() (rows of p, possibly none; FSDP's padding is not part of it).
# The operator's vectors on rank r are the concatenation, in the order of
# model.named_parameters() (after param_filter), of the flattened local
# shards: op.size is the local length and differs across ranks. The global
# vector is the rank-major interleaving of those pieces; nobody ever
# assembles it. Elementwise arithmetic is local, reductions go through
# op.backend (a DistributedBackend), so an algorithm given backend=op.backend
# runs unchanged, and its eigenvectors come back sharded the same way.
#
# Weighting: rank r scales its mean chunk loss by b_r·W/B (B = Σ_r b_r of
# this chunk, exchanged before the backward); FSDP's reduce-scatter averages
# over W ranks, so each rank receives its shard of Σ_r b_r g_r / B: the
# batch-size-weighted gradient of the union of the chunks. The base class
# then weights chunks by B. This assumes FSDP's default gradient averaging
# (no set_gradient_divide_factor, gradient sync enabled).


@functools.lru_cache(maxsize=1)
def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: FSDP2 lived under _composable
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[attr-defined]
        except ImportError:
            return None
    return FSDPModule


def _is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def fsdp2_class(model: nn.Module, replicated: str = "DDPHessianOperator") -> type:
    """FSDP2's module class, after checking that ``model`` is sharded with it (``replicated``:
    the operator a message suggests for a replicated model)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _is_fsdp1(model):
        raise TypeError(
            "FullyShardedDataParallel (FSDP1) flattens parameters and is not supported; shard the "
            "model with torch.distributed.fsdp.fully_shard (FSDP2) instead"
        )
    fsdp_cls = _fsdp_module_type()
    if fsdp_cls is None or not any(isinstance(m, fsdp_cls) for m in model.modules()):
        raise TypeError(
            "the model is not sharded with fully_shard (FSDP2); call fully_shard on its blocks and "
            f"on the root module, or use {replicated} for a replicated model"
        )
    return fsdp_cls


def mesh_group(model: nn.Module, process_group: Any) -> Any:
    """The process group the parameters are sharded over (``process_group`` must span it)."""
    group = None
    for p in model.parameters():
        if is_dtensor(p):
            mesh = p.device_mesh  # type: ignore[attr-defined]
            if mesh.ndim != 1:
                raise NotImplementedError(
                    "only a 1-D device mesh (plain FSDP) is supported; HSDP / 2-D meshes are not"
                )
            group = mesh.get_group()
            break
    if group is None:
        raise TypeError("fully_shard left no sharded parameter in the model")
    if process_group is None:
        return group
    if dist.get_process_group_ranks(process_group) != dist.get_process_group_ranks(group):
        raise ValueError(
            "process_group must span the ranks the parameters are sharded over "
            f"({dist.get_process_group_ranks(group)}); leave it None to use the FSDP mesh's group"
        )
    return process_group


class Sharded(Replicated):
    """The ranks of an FSDP2 mesh (NOTE [sharded vector layout]): every rank the same number of
    chunks, agreed before each (FSDP's forwards and backwards are collectives); each chunk's
    product on this rank's shards, summed over the ranks by the sharded product itself (the
    layer walk's reduce-scatter, FSDP's for central differences); vectors sharded, reduced by a
    :class:`DistributedBackend`. The Kronecker operators take them too (``sharded_kronecker``)."""

    keeps_states = False
    #: each rank holds shards of the parameters and gathers blocks whole: a half model's products
    #: cast each gathered block to float32 (NOTE [half models] in ``precision``), no copy of the
    #: rank's shards is swapped into the modules
    gathers_parameters = True

    def __init__(
        self, model: nn.Module, process_group: Any = None, replicated: str = "DDPHessianOperator"
    ) -> None:
        self.fsdp_cls = fsdp2_class(model, replicated)
        super().__init__(mesh_group(model, process_group), first_device(model))
        #: the chunk products (set when the operator is constructed)
        self.product: ShardedProduct | None = None
        self._chunk_weight = 0.0  # the weight of the chunk the ranks agreed on last (chunks)
        #: whether a factor pass started (``sharded_kronecker``)
        self.started = False

    def reshard(self, model: nn.Module) -> None:
        """Every FSDP module back to its shards (FSDP may keep the root whole after a forward)."""
        for m in model.modules():
            if isinstance(m, self.fsdp_cls):
                m.reshard()  # type: ignore[operator]

    def check_model(self, model: nn.Module, who: str) -> None:
        pass

    def backend(self, backend: LinAlgBackend | None) -> LinAlgBackend:
        return DistributedBackend(self.group) if backend is None else backend

    def constructed(self, op: Any, failure: BaseException | None) -> None:
        signature = (0, 0, 0)
        if failure is None:
            try:
                signature = self._attach(op)
            except Exception as exc:
                failure = exc
        self.agreement.check_layout(failure, signature, f"construction of {type(op).__name__}")

    def _attach(self, op: Any) -> tuple[int, int, int]:
        """``op``'s layout cut to this rank's shards and its sharded product; the whole
        layout's signature."""
        if self.product is not None:
            raise ValueError(
                "these Sharded ranks already serve another operator (they hold its sharded "
                "product); build one Sharded(model) per operator"
            )
        plain = [n for n, p in op.named_params if not is_dtensor(p)]
        if plain:
            raise TypeError(
                f"parameters {plain[:4]} are not sharded; apply fully_shard to the root module too so "
                "that FSDP manages every selected parameter"
            )
        # the global layout is checked across ranks; the operator acts on local shards
        whole = op.layout
        signature = layout_signature(whole.names, whole.shapes, op.dtype)
        #: the whole (unsharded) layout and length; ``layout`` and ``size`` are this rank's
        op.global_layout, op.global_size = whole, whole.size
        local = ParamLayout.from_named([(n, local_shard(p)) for n, p in op.named_params])
        op.layout = dataclasses.replace(local, dtype=op.dtype)  # NOTE [half models]
        op._size = op.layout.size
        op._device = op.layout.device
        # a half model's blocks cast to float32 as they are gathered (NOTE [half models])
        upcast = op.dtype if op.dtype != op.param_dtype else None
        if op.layers is not None:
            check_every_parameter(op.model, op.layout.names)
            shards = ShardGather(op.model, self.fsdp_cls, self.group, dtype=upcast)
            make = getattr(op, "layer_walk_runner", None)
            if make is None:
                raise TypeError(f"{type(op).__name__} has no layer walk")
            walk = make(gather=shards.gather_async, finish=shards.finish_async, agree=shards.agree)
            self.product = ShardedWalk(walk, shards, self.agreement)
        elif op.engine == "functional":
            self.product = ShardedFunctional(
                op.functional_product,
                op._engine_batch,
                op.layout.names,
                ShardGather(op.model, self.fsdp_cls, self.group, dtype=upcast),
                self.agreement,
                op.counts,
            )
        elif getattr(op, "method", None) == "finite_difference":
            if upcast is not None:
                raise ValueError(
                    f"method='finite_difference' on a sharded {str(op.param_dtype).removeprefix('torch.')} model runs FSDP's own "
                    "forward and backward, in the model's dtype; for float32 products pass "
                    "engine='layers' with layers= (or engine='functional'), for products in the "
                    "model's dtype precision='model'"
                )
            self.product = ShardedDifferences(
                op.model,
                op.loss_fn,
                op.params,
                op.guard,
                op.counts,
                op.fd_eps,
                self.fsdp_cls,
                self.agreement,
            )
        else:
            raise TypeError(
                f"{type(op).__name__} given Sharded ranks needs a sharded product: "
                "engine='layers' with layers= (the sharded layer walk: exact, one block whole at "
                "a time), or engine='functional' (its functional_product on the whole model, "
                "gathered on every rank for each chunk)"
            )
        return signature

    # -- one product: the chunk products reduce themselves; the pass finishes as on one rank
    def output(self, V: torch.Tensor, one_pass: bool) -> torch.Tensor:
        return Ranks.output(self, V, one_pass)

    def product_pass(
        self, V: torch.Tensor, out: torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        if self.product is None:
            raise InternalError("a sharded product, set at construction")
        return self.product.scope(V)

    def finish(
        self,
        out: torch.Tensor,
        count: int,
        total: float,
        check: Callable[[int, float], None],
    ) -> None:
        Ranks.finish(self, out, count, total, check)

    def chunks(
        self, chunks: Iterator[tuple[Batch, Batch]], weigh: Callable[[Batch, Batch], float]
    ) -> Iterator[tuple[Batch, Batch]]:
        """The chunks of a pass, the ranks agreeing before each: FSDP forward and backward
        passes are collectives, so all ranks run the same number of chunks. A chunk's weight
        is read inside the agreement too (a batch whose size cannot be read fails on every
        rank, not only on its own)."""
        world = self.world_size
        while True:
            failure: BaseException | None = None
            item: tuple[Batch, Batch] | None = None
            try:
                item = next(chunks, None)
                if item is not None:
                    self._chunk_weight = weigh(*item)
            except Exception as exc:
                failure = exc
            table = self.agreement.agree(failure, float(item is not None), what="reading the data")
            have = [r for r in range(world) if table[r, 0] > 0]
            if not have:
                return
            if len(have) < world:
                done = sorted(set(range(world)) - set(have))
                raise ValueError(
                    f"ranks {done} ran out of batches while ranks {have} have more: with a sharded model "
                    "every rank must yield the same number of batches (and microbatches) per product; "
                    "their sizes may differ"
                )
            if item is None:
                raise InternalError("a chunk on this rank, as on every rank")
            yield item

    def chunk_product(
        self,
        chunk: Batch,
        vecs: list[torch.Tensor],
        product: Callable[[Batch, list[torch.Tensor]], Product],
        weigh: Callable[[], float],
    ) -> tuple[Product, float]:
        if self.product is None:
            raise InternalError("a sharded product, set at construction")
        return self.product(chunk, self._chunk_weight, vecs)

    def __repr__(self) -> str:
        return f"Sharded(rank={self.rank}, world_size={self.world_size})"


class ShardedMixin(DataCurvatureOperator):
    """The sharded constructor of a curvature operator: an FSDP2 model, sharded vectors.

    ``class FSDPMyOperator(ShardedMixin, MyOperator)`` takes ``MyOperator``'s arguments plus
    ``process_group`` (default: the FSDP mesh's group) and ``layers`` (the dotted path to the
    model's list of ``fully_shard``-ed blocks; ``engine="layers"`` may be said too): products are
    exact, by the sharded layer walk (NOTE [sharded layer walk]). It builds ``MyOperator`` given
    :class:`Sharded` ranks (``MyOperator(model, ..., ranks=Sharded(model), engine=...)`` is the
    same without a class). Vectors are sharded (NOTE [sharded vector layout]); ``op.backend`` is a
    :class:`DistributedBackend`: pass it to the algorithms. Every rank passes its own batches, the
    same number of them (their sizes may differ); products equal the single-process product on
    the union of the ranks' batches, weighted by batch size.
    """

    global_layout: ParamLayout
    global_size: int

    def __init__(
        self,
        model: nn.Module,
        *args: Any,
        process_group: Any = None,
        layers: str | Sequence[nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        engine = kwargs.pop("engine", "layers" if layers is not None else "auto")
        if (engine == "layers") != (layers is not None):
            raise ValueError(
                "engine='layers' walks the layers that layers= names (a dotted path to the "
                "model's list of fully_shard'ed blocks, e.g. 'transformer.h'), and layers= "
                f"applies to it only; got engine={engine!r}, layers={layers!r}"
            )
        if engine != "layers":
            kwargs["engine"] = engine
        self.ranks = Sharded(model, process_group)
        super().__init__(model, *args, ranks=self.ranks, **kwargs)
        if layers is not None:
            self.layers = layers  # walked by the ranks' product, not by an engine


class FSDPGGNOperator(ShardedMixin, GGNOperator):
    """:class:`GGNOperator` of a model sharded with FSDP2: its arguments plus ``layers`` (required:
    the dotted path to the ``fully_shard``-ed blocks; ``engine="layers"`` may be said too) and
    ``process_group``; exact products by the sharded layer walk. Monte-Carlo draws are keyed by
    chunk and rank, as in :class:`DDPGGNOperator`. See :class:`ShardedMixin`."""

    def __init__(self, *args: Any, layers: str | Sequence[nn.Module], **kwargs: Any) -> None:
        super().__init__(*args, layers=layers, **kwargs)


class FSDPEmpiricalFisherOperator(ShardedMixin, EmpiricalFisherOperator):
    """:class:`EmpiricalFisherOperator` of a model sharded with FSDP2: its arguments plus
    ``layers`` (required; ``engine="layers"`` may be said too) and ``process_group``; exact
    products by the sharded layer walk. See :class:`ShardedMixin`."""

    def __init__(self, *args: Any, layers: str | Sequence[nn.Module], **kwargs: Any) -> None:
        super().__init__(*args, layers=layers, **kwargs)


# NOTE [deprecated spellings]
# Spellings of the sharded constructors that still work, warn at the user's line with the
# DeprecationWarning subclass of the 0.x facade's table (``deprecation.DeprecatedWarning``,
# ``compat._deprecations``: the package's deprecation warnings are one class) and name what to
# write instead. The facade's table itself is out of reach here (it sits above ``operators``).
DEPRECATED_IN, REMOVED_IN = "1.0.0", "2.0.0"
#: the deprecated spelling -> what to write instead
DEPRECATED_SPELLINGS = {
    "FSDPHessianOperator(method='layers')": (
        "Pass engine='layers' (with layers=), as every operator takes the layer walk"
    ),
}


def warn_deprecated_spelling(name: str) -> None:
    """Warn that ``name`` (a key of ``DEPRECATED_SPELLINGS``) was used, at the user's line."""
    warning = deprecation.DeprecatedWarning(
        name, DEPRECATED_IN, REMOVED_IN, DEPRECATED_SPELLINGS[name] + "."
    )
    warnings.warn(warning, stacklevel=user_stacklevel())


class FSDPHessianOperator(ShardedMixin, HessianOperator):
    """Hessian of a model sharded with FSDP2 ``fully_shard``.

    ``FSDPHessianOperator(model, dataloader, loss_fn, *, param_filter=None,
    full_dataset=True, num_batches=None, microbatch_size=None,
    microbatch_unsafe=False, method="finite_difference", fd_eps=None,
    backend=None, engine="auto", process_group=None, layers=None)``. ``engine="layers"`` with
    ``layers=`` (the dotted path to the blocks): exact products by the sharded layer walk
    (NOTE [sharded layer walk]). Else ``method="finite_difference"``: two FSDP forward–backward
    passes per vector and chunk, no double backward. ``method="layers"`` is the deprecated
    spelling of ``engine="layers"`` (NOTE [deprecated spellings]). See :class:`ShardedMixin` for
    vectors and data.
    """

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Batch],
        loss_fn: LossFn,
        *,
        param_filter: ParamFilter | str | Sequence[str] | None = None,
        full_dataset: bool = True,
        num_batches: int | None = None,
        microbatch_size: int | None = None,
        microbatch_unsafe: bool = False,
        method: Literal["autograd", "finite_difference", "layers"] | None = None,
        fd_eps: float | None = None,
        backend: LinAlgBackend | None = None,
        max_block_size: int | None = None,
        engine: Literal["auto", "layers"] = "auto",
        process_group: Any = None,
        layers: str | Sequence[nn.Module] | None = None,
    ) -> None:
        if method == "layers":
            warn_deprecated_spelling("FSDPHessianOperator(method='layers')")
            method, engine = None, "layers" if engine == "auto" else engine
        if engine not in ("auto", "layers"):
            raise ValueError(
                f"engine must be 'auto' or 'layers' on a sharded model, got {engine!r} (the "
                "functional product of the whole model: HessianOperator(..., "
                "ranks=Sharded(model), engine='functional'))"
            )
        if engine == "layers" and method is not None:
            raise ValueError(
                f"engine='layers' walks the layers exactly; method={method!r} is another product "
                "(pass one of them)"
            )
        if method == "autograd":
            raise NotImplementedError(
                "method='autograd' is not available for FSDP-sharded models: FSDP2 all-gathers the "
                "parameters outside autograd, so no graph links the sharded parameters to the loss and "
                "a double backward cannot reach them. Use engine='layers' with layers= (exact, one "
                "layer at a time), method='finite_difference' (two ordinary forward-backward passes "
                "per product), or DDPHessianOperator on a replicated model."
            )
        super().__init__(
            model,
            dataloader,
            loss_fn,
            param_filter=param_filter,
            full_dataset=full_dataset,
            num_batches=num_batches,
            microbatch_size=microbatch_size,
            microbatch_unsafe=microbatch_unsafe,
            # the walk differentiates exactly; the base's method only says which hooks exist
            method="autograd" if engine == "layers" else "finite_difference",
            fd_eps=fd_eps,
            backend=backend,
            max_block_size=max_block_size,
            engine=engine,
            process_group=process_group,
            layers=layers,
        )
