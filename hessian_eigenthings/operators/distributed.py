"""Curvature products with the data (DDP) or the parameters (FSDP) split across ranks.

**Data parallel** (:class:`DDPHessianOperator`, :class:`DDPGGNOperator`,
:class:`DDPEmpiricalFisherOperator`, and :class:`DataParallelMixin` on any
:class:`~hessian_eigenthings.operators.base.DataCurvatureOperator`):
every rank holds the whole model and its own shard of the data, of any size.
Rank ``r`` runs the ordinary data loop over its chunks ``i`` and gets
``S_r = Σ_i b_ri·P_ri`` and ``B_r = Σ_i b_ri``; the product is

    C v = (Σ_r S_r) / (Σ_r B_r),

the single-process product over the union of the ranks' batches weighted by
batch size, whatever the shard sizes. One all-reduce per product carries
``[S_r (k·n) | B_r | f_0 … f_{W-1}]`` in the operator's flat output buffer,
where ``f_r`` = 1 when rank ``r`` failed; every rank reads the ``1 + W``
trailing numbers (one host sync per product, the price of raising instead of
hanging) and raises together, naming the failed ranks. 16-bit dtypes cannot
hold sample counts exactly, so there the counts and flags go in a tiny float64
all-reduce first and the data follows in a second one.
Cost per product: the local product on ``1/W`` of the data, plus one
all-reduce of ``k·n + 1 + W`` elements (a ring sends about ``2·k·n`` elements
per rank) and, when a rank runs a single chunk, one extra scaling of the
output by ``b``. Vectors are replicated: every rank passes the same ``v`` and
gets the same ``C v``, bit for bit.

**Sharded** (:class:`FSDPHessianOperator`): parameters sharded with FSDP2
(``fully_shard``), vectors sharded the same way. See NOTE [sharded vector
layout]. Central differences ``H v ≈ (g(θ + h v̂) − g(θ − h v̂))·‖v‖ / 2h``
with ``g`` from ordinary FSDP forward–backward passes: FSDP's reduce-scatter
hands each rank its shard of the data-averaged gradient, so the product
arrives sharded and already reduced. Cost per vector and chunk: two FSDP
forward–backward passes (their all-gathers and reduce-scatters) and two status
all-reduces of ``2·W`` numbers; per product one all-reduce of the ``k``
vector norms and one status all-reduce per chunk. Autograd (double backward)
is refused: FSDP2 all-gathers parameters outside autograd, so no graph links
the sharded parameters to the loss.

**Sharded Kronecker factors** (:class:`FSDPKFACOperator`, :class:`FSDPEKFACOperator`,
:class:`ShardedKroneckerMixin`): the factor pass is first-order FSDP forwards and backwards on
each rank's batches, the factor sums all-reduced; factors replicated on every rank, vectors
sharded. Cost per product: one all-gather per layer of its ``k`` vectors' pieces and the
layer's block products on its whole parameters. See NOTE [sharded Kronecker factors].
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch, BatchSource, batch_size
from hessian_eigenthings.linalg import LinAlgBackend
from hessian_eigenthings.linalg_distributed import (
    DistributedBackend,
    is_main_process,
    resolve_process_group,
)
from hessian_eigenthings.loss_fns.output_curvature import OutputCurvature
from hessian_eigenthings.operators.autodiff import scalar_loss
from hessian_eigenthings.operators.base import DataCurvatureOperator
from hessian_eigenthings.operators.cuda_graphs import Product
from hessian_eigenthings.operators.engines.runner import ProductRunner
from hessian_eigenthings.operators.factor_pass import FactorPass
from hessian_eigenthings.operators.fisher import EmpiricalFisherOperator
from hessian_eigenthings.operators.ggn import GGNOperator
from hessian_eigenthings.operators.hessian import HessianOperator, LossFn
from hessian_eigenthings.operators.kfac import EKFACOperator, KFACOperator, LayerKroneckerOperator
from hessian_eigenthings.operators.kronecker import (
    Eigen,
    KroneckerBlock,
    KroneckerEigenBlock,
    KroneckerOperator,
)
from hessian_eigenthings.operators.layer_walk import LayerWalkRunner
from hessian_eigenthings.operators.sharded_walk import ShardGather, chunk_rows
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout, RowBlock

__all__ = [
    "DDPEKFACOperator",
    "DDPEmpiricalFisherOperator",
    "DDPGGNOperator",
    "DDPHessianOperator",
    "DDPKFACOperator",
    "DataParallelMixin",
    "DistributedBackend",
    "DistributedProductError",
    "FSDPEKFACOperator",
    "FSDPEmpiricalFisherOperator",
    "FSDPGGNOperator",
    "FSDPHessianOperator",
    "FSDPKFACOperator",
    "KroneckerDataParallelMixin",
    "ShardedKroneckerMixin",
    "ShardedMixin",
    "is_main_process",
]


class DistributedProductError(RuntimeError):
    """Raised on every rank that did not fail itself when some rank failed
    during a collective step (construction or a product); ``ranks`` lists them.
    The failed ranks raise their own exception."""

    def __init__(self, ranks: Sequence[int], world_size: int, what: str) -> None:
        self.ranks = tuple(ranks)
        names = ", ".join(str(r) for r in self.ranks)
        super().__init__(
            f"rank {names} of {world_size} raised during {what}; see that rank's traceback. "
            "This rank stops too, so that no rank waits forever in a collective."
        )


# --------------------------------------------------------------------------
# Agreement between ranks
# --------------------------------------------------------------------------


class _RankGroup:
    """A process group plus the small collective checks the operators share."""

    def __init__(self, process_group: Any, device: torch.device) -> None:
        self.group = resolve_process_group(process_group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = device

    def exchange(self, row: Sequence[float]) -> torch.Tensor:
        """Every rank's ``row``, as a ``(W, len(row))`` float64 table on the host.

        An all-reduce of a table that is zero outside this rank's row: an
        all-gather that works on every backend, exact for flags and counts.
        """
        table = torch.zeros(self.world_size, len(row), dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor(row, dtype=torch.float64)
        dist.all_reduce(table, group=self.group)
        return table.cpu()

    def raise_for(self, failed: Sequence[int], own: BaseException | None, what: str) -> None:
        """Raise on every rank when any rank failed: the failed rank its own
        exception (annotated with its rank), the others :class:`DistributedProductError`."""
        if own is not None:
            note = f"[hessian_eigenthings] raised on rank {self.rank} of {self.world_size} during {what}"
            if hasattr(own, "add_note"):  # Python >= 3.11
                own.add_note(note)
            raise own
        if failed:
            raise DistributedProductError(failed, self.world_size, what)

    def check_layout(
        self, failure: BaseException | None, signature: tuple[int, int, int], what: str
    ) -> None:
        """Every rank built an operator over the same parameters (count, tensors, names and shapes)."""
        table = self.exchange([float(failure is not None), *map(float, signature)])
        failed = [r for r in range(self.world_size) if table[r, 0] > 0]
        self.raise_for(failed, failure, what)
        rows = [tuple(int(x) for x in table[r, 1:]) for r in range(self.world_size)]
        if len(set(rows)) > 1:
            detail = "; ".join(
                f"rank {r}: {row[0]} parameters in {row[1]} tensors" for r, row in enumerate(rows)
            )
            raise ValueError(
                f"the ranks selected different parameters ({detail}; names/shapes checksum "
                f"{[row[2] for row in rows]}). Every rank must build the operator over the same model "
                "with the same param_filter."
            )


def _layout_signature(
    names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype
) -> tuple[int, int, int]:
    numel = sum(math.prod(s) for s in shapes)
    # crc32, not hash(): Python randomizes str hashes per process
    crc = zlib.crc32(repr((list(names), [tuple(s) for s in shapes], str(dtype))).encode())
    return numel, len(names), crc


def _first_device(model: Any) -> torch.device:
    """Where the collectives' small tensors live (the model's device: NCCL needs CUDA).
    Never raises: a bad model must fail inside the constructor, after the ranks agreed."""
    if isinstance(model, nn.Module):
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter: a view sharing its storage."""
    return p.to_local() if _is_dtensor(p) else p  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=1)
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 kept it private
        try:
            from torch.distributed._tensor import DTensor  # type: ignore[attr-defined]
        except ImportError:
            return None
    return DTensor


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


def _is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def _is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


# --------------------------------------------------------------------------
# Data parallel: replicated model, data split across ranks
# --------------------------------------------------------------------------

# NOTE [DDP wrapper]
# A model wrapped in DistributedDataParallel is unwrapped to `model.module`,
# and `loss_fn` receives the inner module. Products through the wrapper would
# work too (checked on torch 2.13 and 2.15: `autograd.grad` runs no AccumulateGrad
# node, so DDP's gradient hooks never fire, and no "reduction not finished"
# error follows), but every wrapper forward broadcasts buffers from rank 0
# and prepares the reducer: a collective per forward that deadlocks as soon
# as ranks run different numbers of batches, and per-forward overhead
# (plus a C++ warning with find_unused_parameters=True). Our one all-reduce
# per product is all the communication a product needs.


def _join_ranks(op: Any, process_group: Any, model: nn.Module) -> _RankGroup:
    """``op``'s ranks: ``_ranks``, ``process_group``, ``rank`` and ``world_size`` set on it."""
    ranks = _RankGroup(process_group, _first_device(model))
    op._ranks = ranks
    op.process_group = ranks.group
    op.rank = ranks.rank
    op.world_size = ranks.world_size
    return ranks


def _replica_ranks(op: Any, model: nn.Module, process_group: Any) -> tuple[nn.Module, _RankGroup]:
    """A replicated model's operator joins its ranks: a ``DistributedDataParallel`` wrapper is
    unwrapped (NOTE [DDP wrapper]) and its group is the default ``process_group``."""
    if isinstance(model, DistributedDataParallel):
        if process_group is None:
            process_group = getattr(model, "process_group", None)
        model = model.module
    return model, _join_ranks(op, process_group, model)


class DataParallelMixin(DataCurvatureOperator):
    """Turns a data-driven curvature operator into its data-parallel version.

    ``class DDPMyOperator(DataParallelMixin, MyOperator): pass`` takes
    ``MyOperator``'s arguments plus ``process_group`` (default: the DDP
    wrapper's group, else the default group). Each rank passes its own
    dataloader shard; products equal the single-process product over the
    union of the shards, weighted by batch size, and are identical on every
    rank. Vectors are replicated, so the backend stays the single-device one.
    """

    _ranks: _RankGroup
    process_group: Any
    rank: int
    world_size: int
    #: engine="auto" does not time engines per rank (ranks could choose differently and their
    #: trial passes would not pair up in the all-reduce): autograd unless engine= says otherwise
    auto_trials = False

    def __init__(
        self, model: nn.Module, *args: Any, process_group: Any = None, **kwargs: Any
    ) -> None:
        model, ranks = _replica_ranks(self, model, process_group)
        self._flat: torch.Tensor | None = None
        self._reduced = False
        failure: BaseException | None = None
        signature = (0, 0, 0)
        try:
            if isinstance(model, nn.Module) and any(_is_dtensor(p) for p in model.parameters()):
                raise TypeError(
                    f"the model's parameters are sharded (FSDP2 / DTensor); {type(self).__name__} needs a "
                    "replicated model: use FSDPHessianOperator for sharded models"
                )
            super().__init__(model, *args, **kwargs)
            # CUDA graphs are not validated across ranks yet: eager products
            self.supports_cuda_graphs = False
            signature = _layout_signature(self.layout.names, self.layout.shapes, self.dtype)
        except Exception as exc:
            failure = exc
        # a rank that failed still joins, so that the others raise instead of waiting
        ranks.check_layout(failure, signature, f"construction of {type(self).__name__}")

    def _products(self, V: torch.Tensor) -> torch.Tensor:
        k = V.shape[0]
        if self._block_limit(k) < k:
            return super()._products(V)  # several passes: each reduces through a packed copy
        # One pass: allocate the output with room for the count and the flags
        # behind it, so that the all-reduce runs in place on the output buffer.
        n = self.size
        flat = torch.empty(k * n + 1 + self.world_size, dtype=self.dtype, device=self.device)
        out = flat[: k * n].view(k, n)
        self._flat = flat
        try:
            self._pass(V, out)
        finally:
            self._flat = None
        return out

    def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        self._reduced = False
        try:
            super()._pass(V, out)
        except Exception as exc:
            if self._reduced:
                raise
            # join the all-reduce the other ranks wait in, flagged; raises on every rank
            self._reduce(out, 0, 0, exc)
            raise

    def _finish_pass(self, out: torch.Tensor, count: int, total: float) -> None:
        self._reduce(out, count, total, None)

    def _reduce(
        self, out: torch.Tensor, count: int, total: float, failure: BaseException | None
    ) -> None:
        """``out ← Σ_r S_r / Σ_r B_r`` in one all-reduce; raise everywhere if a rank failed."""
        self._reduced = True
        ranks = self._ranks
        m = out.numel()
        if failure is None and count == 1:
            out.mul_(float(total))  # P₁ → b₁·P₁, so that ranks add up as Σ b·P
        if self.dtype not in (torch.float32, torch.float64):
            table = ranks.exchange([float(failure is not None), float(total)])
            ranks.raise_for(
                [r for r in range(ranks.world_size) if table[r, 0] > 0], failure, "a product"
            )
            dist.all_reduce(out, group=ranks.group)
            out.mul_(1.0 / float(table[:, 1].sum()))
            return
        flat = self._flat
        in_place = (
            flat is not None
            and flat.data_ptr() == out.data_ptr()
            and flat.numel() == m + 1 + ranks.world_size
        )
        if in_place:
            assert flat is not None
            buf = flat
        else:
            buf = torch.empty(m + 1 + ranks.world_size, dtype=self.dtype, device=self.device)
            buf[:m].copy_(out.reshape(-1))
        tail = torch.zeros(1 + ranks.world_size, dtype=torch.float64)
        tail[0] = float(total)
        if failure is not None:
            tail[1 + ranks.rank] = 1.0
        buf[m:].copy_(tail)
        dist.all_reduce(buf, group=ranks.group)
        status = buf[m:].cpu()  # the one host sync of a product
        failed = [r for r in range(ranks.world_size) if status[1 + r] > 0]
        ranks.raise_for(failed, failure, "a product")
        inv = 1.0 / float(status[0])
        if in_place:
            out.mul_(inv)
        else:
            torch.mul(buf[:m].view_as(out), inv, out=out)


class DDPHessianOperator(DataParallelMixin, HessianOperator):
    """:class:`HessianOperator` with the data split across ranks.

    ``DDPHessianOperator(model, dataloader, loss_fn, *, ..., process_group=None)``:
    the arguments of :class:`HessianOperator` plus ``process_group``.
    ``model`` may be wrapped in ``DistributedDataParallel`` (see NOTE [DDP wrapper]);
    ``dataloader`` is this rank's shard (e.g. a ``DistributedSampler``, shards
    of any size). Both methods work; graph reuse and blocks work per rank.
    """


class DDPGGNOperator(DataParallelMixin, GGNOperator):
    """:class:`GGNOperator` with the data split across ranks: its arguments plus
    ``process_group``. See :class:`DDPHessianOperator`."""


class DDPEmpiricalFisherOperator(DataParallelMixin, EmpiricalFisherOperator):
    """:class:`EmpiricalFisherOperator` with the data split across ranks: its
    arguments plus ``process_group``; ``(1/N) Σ gᵢgᵢᵀ`` over the samples of
    every rank. See :class:`DDPHessianOperator`."""


class KroneckerDataParallelMixin:
    """Turns a KFAC-family operator into its data-parallel version: each rank runs the factor
    passes over its own batches (of any size and number) and the factors' sums and sample counts
    are summed over the ranks (one status exchange and one all-reduce per pass), so every rank
    holds the factors of the union of the batches. ``class DDPMyKFAC(KroneckerDataParallelMixin,
    MyKFAC)`` takes ``MyKFAC``'s arguments plus ``process_group``; the model is replicated (a
    ``DistributedDataParallel`` wrapper is unwrapped). Monte-Carlo draws are keyed by rank.
    """

    _pass: Any
    _ranks: _RankGroup
    process_group: Any
    rank: int
    world_size: int

    def __init__(
        self, model: nn.Module, *args: Any, process_group: Any = None, **kwargs: Any
    ) -> None:
        model, _ = _replica_ranks(self, model, process_group)
        self._exchanged = False
        super().__init__(model, *args, **kwargs)  # type: ignore[call-arg]

    def _start_pass(self, factor_pass: Any) -> None:
        super()._start_pass(factor_pass)  # type: ignore[misc]
        factor_pass.rank = self.rank

    def _agreed(self, run: Any) -> Any:
        """``run()`` (a factor pass and its sums); a rank that fails before the ranks exchange
        their status joins the exchange flagged, so that every rank raises."""
        self._exchanged = False
        try:
            return run()
        except Exception as exc:
            if not self._exchanged:
                self._exchanged = True
                table = self._ranks.exchange([1.0, 0.0])
                failed = [r for r in range(self.world_size) if table[r, 0] > 0]
                self._ranks.raise_for(failed, exc, "a factor pass")
            raise

    def _kfac_factors(self) -> Any:
        return self._agreed(super()._kfac_factors)  # type: ignore[misc]

    def _compute_scalings(self, bases: Any) -> Any:
        scalings = super()._compute_scalings  # type: ignore[misc]
        return self._agreed(lambda: scalings(bases))

    sums_over_processes = True

    def _sum_over_processes(self, sums: list[torch.Tensor], total: float) -> float:
        self._exchanged = True
        table = self._ranks.exchange([0.0, float(total)])
        self._ranks.raise_for(
            [r for r in range(self.world_size) if table[r, 0] > 0], None, "a factor pass"
        )
        if sums:
            flat = torch.cat([t.reshape(-1) for t in sums])
            dist.all_reduce(flat, group=self._ranks.group)
            offset = 0
            for t in sums:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return float(table[:, 1].sum())


class DDPKFACOperator(KroneckerDataParallelMixin, KFACOperator):
    """:class:`KFACOperator` with the data split across ranks: its arguments plus
    ``process_group``; the factors of the union of the ranks' batches on every rank. See
    :class:`KroneckerDataParallelMixin`."""


class DDPEKFACOperator(KroneckerDataParallelMixin, EKFACOperator):
    """:class:`EKFACOperator` with the data split across ranks (both passes summed over the
    ranks). See :class:`KroneckerDataParallelMixin`."""


# --------------------------------------------------------------------------
# Sharded: FSDP2 parameters, sharded vectors
# --------------------------------------------------------------------------

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


def _fsdp2_class(model: nn.Module, replicated: str = "DDPHessianOperator") -> type:
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


def _mesh_group(model: nn.Module, process_group: Any) -> Any:
    """The process group the parameters are sharded over (``process_group`` must span it)."""
    group = None
    for p in model.parameters():
        if _is_dtensor(p):
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


class ShardedMixin(DataCurvatureOperator):
    """Turns a curvature operator into its sharded version: an FSDP2 model, sharded vectors.

    ``class FSDPMyOperator(ShardedMixin, MyOperator)`` takes ``MyOperator``'s arguments plus
    ``process_group`` (default: the FSDP mesh's group) and ``layers`` (the dotted path to the
    model's list of ``fully_shard``-ed blocks): products are exact, by the sharded layer walk
    (NOTE [sharded layer walk]). Vectors are sharded (NOTE [sharded vector layout]);
    ``op.backend`` is a :class:`DistributedBackend`: pass it to the algorithms. Every rank passes
    its own batches, the same number of them (their sizes may differ); products equal the
    single-process product on the union of the ranks' batches, weighted by batch size.
    """

    _ranks: _RankGroup
    process_group: Any
    rank: int
    world_size: int
    #: ranks must run the same engine: no per-rank timing trials
    auto_trials = False

    def __init__(
        self,
        model: nn.Module,
        *args: Any,
        process_group: Any = None,
        layers: str | Sequence[nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        fsdp_cls = _fsdp2_class(model)
        ranks = _join_ranks(self, _mesh_group(model, process_group), model)
        self._fsdp_cls = fsdp_cls
        self._chunk_weight = 0.0  # the weight of the chunk the ranks agreed on last (_fresh_chunks)
        #: the exact walk's runner and its gathering (NOTE [sharded layer walk])
        self._walk_runner: LayerWalkRunner | None = None
        self._shards: ShardGather | None = None
        failure: BaseException | None = None
        signature = (0, 0, 0)
        try:
            super().__init__(model, *args, graph_reuse=False, **kwargs)
            self.supports_cuda_graphs = False
            signature = self._shard_layout(kwargs.get("backend"))
            if layers is not None:
                self.layers = layers
                self._shards = ShardGather(model, fsdp_cls, ranks.group, self.layout.names)
                make = getattr(self, "layer_walk_runner", None)
                if make is None:
                    raise TypeError(f"{type(self).__name__} has no layer walk")
                self._walk_runner = make(
                    gather=self._shards.gather,
                    finish=self._shards.finish,
                    agree=self._shards.agree,
                )
        except Exception as exc:
            failure = exc
        ranks.check_layout(failure, signature, f"construction of {type(self).__name__}")

    def _shard_layout(self, backend: LinAlgBackend | None) -> tuple[int, int, int]:
        """This rank's shards as the operator's layout; the whole layout's signature."""
        plain = [n for n, p in self.named_params if not _is_dtensor(p)]
        if plain:
            raise TypeError(
                f"parameters {plain[:4]} are not sharded; apply fully_shard to the root module too so "
                "that FSDP manages every selected parameter"
            )
        # the global layout is checked across ranks; the operator acts on local shards
        signature = _layout_signature(self.layout.names, self.layout.shapes, self.dtype)
        #: length of the whole (unsharded) vector; ``size`` is this rank's shard
        self.global_size = self.layout.size
        self.layout = ParamLayout.from_named([(n, _local(p)) for n, p in self.named_params])
        self._size = self.layout.size
        self._device = self.layout.device
        if backend is None:
            self.backend = DistributedBackend(self._ranks.group)
        return signature

    def _fresh_chunks(self) -> Iterator[tuple[Batch, Batch]]:
        """The base's chunks of a pass, with the ranks agreeing before each: FSDP forward and
        backward passes are collectives, so all ranks run the same number of chunks. A chunk's
        weight is read inside the agreement too (a batch whose size cannot be read fails on
        every rank, not only on its own)."""
        ranks = self._ranks
        chunks = super()._fresh_chunks()
        while True:
            failure: BaseException | None = None
            item: tuple[Batch, Batch] | None = None
            try:
                item = next(chunks, None)
                if item is not None:
                    self._chunk_weight = self._weight(self._samples(item[1]), item[0])
            except Exception as exc:
                failure = exc
            table = ranks.exchange([float(failure is not None), float(item is not None)])
            ranks.raise_for(
                [r for r in range(ranks.world_size) if table[r, 0] > 0], failure, "reading the data"
            )
            have = [r for r in range(ranks.world_size) if table[r, 1] > 0]
            if not have:
                return
            if len(have) < ranks.world_size:
                done = sorted(set(range(ranks.world_size)) - set(have))
                raise ValueError(
                    f"ranks {done} ran out of batches while ranks {have} have more: with a sharded model "
                    "every rank must yield the same number of batches (and microbatches) per product; "
                    "their sizes may differ"
                )
            assert item is not None
            yield item

    def _chunk_product(
        self, raw: Batch, chunk: Batch, rows: RowBlock, runner: ProductRunner, graphs: bool
    ) -> tuple[Product, float]:
        """The exact product of the ranks' chunks by the sharded layer walk; the ranks agree
        after each one's forward (a failure then raises on every rank)."""
        walk, shards, ranks = self._walk_runner, self._shards, self._ranks
        assert walk is not None and shards is not None
        with self.guard.private_buffers():
            failure: BaseException | None = None
            state = None
            try:
                shards.reshard()
                state = walk.prepare(chunk)  # an ordinary FSDP forward, without a graph
            except Exception as exc:
                failure = exc
            table = ranks.exchange([float(failure is not None), float(self._chunk_weight)])
            ranks.raise_for(
                [r for r in range(ranks.world_size) if table[r, 0] > 0], failure, "a product"
            )
            total = float(table[:, 1].sum())
            assert state is not None
            with shards.walking(self._chunk_weight / total):
                return list(walk.apply(state, rows.views, False)), total


class FSDPGGNOperator(ShardedMixin, GGNOperator):
    """:class:`GGNOperator` of a model sharded with FSDP2: its arguments plus ``layers`` (required:
    the dotted path to the ``fully_shard``-ed blocks) and ``process_group``; exact products by the
    sharded layer walk. Monte-Carlo draws are keyed by chunk and rank, as in
    :class:`DDPGGNOperator`. See :class:`ShardedMixin`."""

    def __init__(self, *args: Any, layers: str | Sequence[nn.Module], **kwargs: Any) -> None:
        super().__init__(*args, layers=layers, **kwargs)


class FSDPEmpiricalFisherOperator(ShardedMixin, EmpiricalFisherOperator):
    """:class:`EmpiricalFisherOperator` of a model sharded with FSDP2: its arguments plus
    ``layers`` (required) and ``process_group``; exact products by the sharded layer walk. See
    :class:`ShardedMixin`."""

    def __init__(self, *args: Any, layers: str | Sequence[nn.Module], **kwargs: Any) -> None:
        super().__init__(*args, layers=layers, **kwargs)


class FSDPHessianOperator(ShardedMixin, HessianOperator):
    """Hessian of a model sharded with FSDP2 ``fully_shard``.

    ``FSDPHessianOperator(model, dataloader, loss_fn, *, param_filter=None,
    full_dataset=True, num_batches=None, microbatch_size=None,
    microbatch_unsafe=False, method="finite_difference", fd_eps=None,
    backend=None, process_group=None, layers=None)``. ``method="layers"`` with
    ``layers=`` (the dotted path to the blocks): exact products by the sharded layer walk
    (NOTE [sharded layer walk]). ``"finite_difference"``: two FSDP forward–backward passes per
    vector and chunk, no double backward. See :class:`ShardedMixin` for vectors and data.
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
        method: Literal["autograd", "finite_difference", "layers"] = "finite_difference",
        fd_eps: float | None = None,
        backend: LinAlgBackend | None = None,
        max_block_size: int | None = None,
        process_group: Any = None,
        layers: str | Sequence[nn.Module] | None = None,
    ) -> None:
        if (method == "layers") != (layers is not None):
            raise ValueError(
                "method='layers' walks the layers that layers= names (a dotted path to the model's "
                "list of fully_shard'ed blocks, e.g. 'transformer.h'), and layers= applies to it only; "
                f"got method={method!r}, layers={layers!r}"
            )
        if method == "autograd":
            raise NotImplementedError(
                "method='autograd' is not available for FSDP-sharded models: FSDP2 all-gathers the "
                "parameters outside autograd, so no graph links the sharded parameters to the loss and "
                "a double backward cannot reach them. Use method='layers' with layers= (exact, one "
                "layer at a time), method='finite_difference' (two ordinary forward-backward passes "
                "per product), or DDPHessianOperator on a replicated model."
            )
        self._scales: torch.Tensor | None = None
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
            method="autograd" if layers is not None else "finite_difference",
            fd_eps=fd_eps,
            backend=backend,
            max_block_size=max_block_size,
            process_group=process_group,
            layers=layers,
        )
        if layers is not None:
            self.method = "layers"  # type: ignore[assignment]

    def _pass(self, V: torch.Tensor, out: torch.Tensor) -> None:
        if self._walk_runner is not None:
            super()._pass(V, out)
            return
        # the step h·v/‖v‖ needs the norm of the whole vector: one all-reduce of k numbers
        sq = torch.linalg.vector_norm(V, dim=1).square()
        dist.all_reduce(sq, group=self._ranks.group)
        self._scales = self.fd_eps / sq.sqrt().clamp_min(torch.finfo(V.dtype).tiny ** 0.5)
        user_grads = [p.grad for p in self.params]
        try:
            # the padding lookups read the rows of θ, not of θ ± h·v̂ (NOTE [padding rows])
            with self.guard.padding.frozen(self._padding_rows()):
                super()._pass(V, out)
        finally:
            self._scales = None
            for p, g in zip(self.params, user_grads, strict=True):
                p.grad = g

    def _padding_rows(self) -> dict[nn.Module, torch.Tensor]:
        """Each padding embedding's padding row, whole on every rank: FSDP2 gives rank r rows
        ``[r·c, (r + 1)·c)`` of a weight, so the row is copied out by its owner and summed over
        the ranks (one all-reduce of the rows, once per pass; none without such embeddings)."""
        hooks = self.guard.padding.hooks
        if not hooks:
            return {}
        ranks = self._ranks
        rows: dict[nn.Module, torch.Tensor] = {}
        for h in hooks:
            weight, pad = h.module.weight.detach(), int(h.module.padding_idx or 0)
            local = _local(weight)
            row = torch.zeros(weight.shape[1:], dtype=local.dtype, device=local.device)
            if not _is_dtensor(weight):
                row.copy_(weight[pad])
            else:
                chunk = -(-weight.shape[0] // ranks.world_size)
                start = ranks.rank * chunk
                if start <= pad < start + local.shape[0]:
                    row.copy_(local[pad - start])
                dist.all_reduce(row, group=ranks.group)
            rows[h.module] = row
        return rows

    def _chunk_product(
        self, raw: Batch, chunk: Batch, rows: RowBlock, runner: ProductRunner, graphs: bool
    ) -> tuple[Product, float]:
        if self._walk_runner is not None:
            return super()._chunk_product(raw, chunk, rows, runner, graphs)
        with self.guard.private_buffers():
            return self._sharded_product(chunk, self._chunk_weight, rows.views)

    def _sharded_product(
        self, chunk: Batch, weight: float, vecs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], float]:
        """Central differences on one chunk; returns the product over the union of the
        ranks' chunks and their total weight (``weight``: this chunk's, see ``_weight``)."""
        assert self._scales is not None
        shards = [_local(p) for p in self.params]
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
            if isinstance(m, self._fsdp_cls):
                m.reshard()  # type: ignore[operator]
        with torch.no_grad():
            for s, x, vi in zip(shards, saved, v, strict=True):
                s.copy_(vi).mul_(scale).add_(x)

    def _global_grad(self, chunk: Batch, b: float) -> tuple[list[torch.Tensor | None], float]:
        """This rank's shard of the ``b``-weighted gradient over the ranks' chunks, and
        the chunks' total weight. See NOTE [sharded vector layout] on the weighting."""
        ranks = self._ranks
        self.num_forwards += 1
        failure: BaseException | None = None
        loss: torch.Tensor | None = None
        try:
            loss = scalar_loss(self.loss_fn(self.model, chunk))
        except Exception as exc:
            failure = exc
        # agree before the backward: its reduce-scatters would wait forever for a failed rank
        table = ranks.exchange([float(failure is not None), float(b)])
        ranks.raise_for(
            [r for r in range(ranks.world_size) if table[r, 0] > 0], failure, "a product"
        )
        assert loss is not None
        total = float(table[:, 1].sum())
        for p in self.params:
            p.grad = None
        (loss * (b * ranks.world_size / total)).backward()
        grads = [None if p.grad is None else _local(p.grad) for p in self.params]
        for p in self.params:
            p.grad = None
        return grads, total


# --------------------------------------------------------------------------
# Sharded Kronecker factors: FSDP2 parameters, replicated factors, sharded vectors
# --------------------------------------------------------------------------

# NOTE [sharded Kronecker factors]
# Factors. FSDP2 shards parameters, never activations: inside a fully_shard'ed
# module's forward its layers run on whole (gathered) weights, so the factor
# pass's hooks see each layer's whole input and, in the backward to the layer
# outputs, the whole output gradients of this rank's samples. The pass is the
# single-process pass on this rank's batches (the tests check it against
# KFACOperator on the union of the ranks' batches), run as ordinary
# first-order FSDP forwards and backwards (to the layer outputs: no parameter
# gradient is made, so no reduce-scatter runs); the factor sums are then
# all-reduced as KroneckerDataParallelMixin's. FSDP's forwards and backwards
# are collectives, so the ranks meet twice per batch: before its forward
# (every rank has a batch or none has; empty on every rank or on none) and
# between its forward and its backward (every rank's forward and loss went
# through, with the same number of loss-Hessian columns, hence the same number
# of backwards). A failure found there raises on every rank; one inside the
# model's forward or backward leaves the other ranks in FSDP's own collectives
# until the group's timeout, as in FSDP training.
#
# Products. The factors are replicated: every rank holds every layer's G and A
# (Σ m² + q² numbers, as one process; sharding the layers' factors over the
# ranks is a possible later step). Vectors are sharded (NOTE [sharded vector
# layout]). Per layer and product: one all-gather of the layer's pieces of the
# k vectors (each rank's rows padded to FSDP's chunk and packed; a rank's piece
# may be short or empty: FSDP2's torch.chunk split of dim 0), the layer's
# blocks applied to its whole parameters as in one process (a Conv2d kernel
# flattened, a Conv1D weight transposed, a bias joined or alone, whichever
# factor dim 0 meets), and this rank's rows kept. A rank holds at most one
# layer's k vectors whole; the blocks' arithmetic (two small matrix products
# each) is repeated on every rank.


class _ShardedLayer:
    """One layer's blocks over its whole parameters, and where its entries sit on the ranks.

    ``take``: the columns of this rank's vector holding its rows of the layer, in the layer's
    order; ``mine``: the same entries' columns in the layer's whole vector; ``place``: each whole
    entry's column in the gathered pieces (``W`` pieces of ``pad`` columns, rank after rank)."""

    def __init__(
        self,
        op: KroneckerOperator,
        blocks: range,
        whole: ParamLayout,
        local: ParamLayout,
        indices: Sequence[int],
        rank: int,
        world: int,
    ) -> None:
        self.op = op
        self.blocks = blocks
        rows = [chunk_rows(whole.shapes[i][0], world) for i in indices]  # per parameter, rank
        widths = [whole.shapes[i][1:].numel() for i in indices]
        # where each parameter's piece starts in each rank's packed pieces
        starts = [[0] * world]
        for n, width in zip(rows, widths, strict=True):
            starts.append([s + r * width for s, r in zip(starts[-1], n, strict=True)])
        self.pad = max(starts.pop())
        take, mine, place = [], [], []
        offset = 0  # the parameter's offset in the layer's whole vector
        for i, n, width, at in zip(indices, rows, widths, starts, strict=True):
            chunk = max(n[0], 1)
            row = torch.arange(whole.shapes[i][0])
            owner = row // chunk  # whole row ρ is row ρ - r·chunk of rank r = ρ // chunk
            first = owner * self.pad + torch.tensor(at)[owner] + (row - owner * chunk) * width
            place.append((first.unsqueeze(1) + torch.arange(width)).reshape(-1))
            count = n[rank] * width
            mine.append(offset + sum(n[:rank]) * width + torch.arange(count))
            take.append(local.offsets[i] + torch.arange(count))
            offset += whole.shapes[i].numel()
        self.take = torch.cat(take).to(local.device)
        self.mine = torch.cat(mine).to(local.device)
        self.place = torch.cat(place).to(local.device)


_END: Any = object()  # no batch left


class _AgreedBatches(BatchSource):
    """A factor pass's batches, the ranks meeting before each (NOTE [sharded Kronecker factors]):
    every rank has one, or none has; empty on every rank, or on none."""

    def __init__(self, source: BatchSource, op: ShardedKroneckerMixin) -> None:
        super().__init__(
            source.dataloader,
            full_dataset=source.full_dataset,
            num_batches=source.num_batches,
            device=source.device,
        )
        self._op = op

    def batches(self) -> Iterator[Batch]:
        fresh = super().batches()
        for position in itertools.count():
            failure: BaseException | None = None
            batch: Any = _END
            # 0: no batch left; 1: a batch; 2: an empty batch (the pass skips it without a forward)
            state = 0.0
            try:
                batch = next(fresh, _END)
                if batch is not _END:
                    state = 1.0 + float(batch_size(batch) == 0)
            except Exception as exc:
                failure = exc
            table = self._op._meet(failure, state)
            states = table[:, 1].tolist()
            if len(set(states)) > 1:
                what = {0.0: "no batch left", 1.0: "a batch", 2.0: "an empty batch"}
                seen = "; ".join(f"rank {r}: {what[s]}" for r, s in enumerate(states))
                self._op._refuse(
                    f"at batch {position} the ranks differ ({seen}). FSDP's forward and backward "
                    "are collectives: with a sharded model every rank must yield the same number of "
                    "batches, and an empty batch on every rank or on none (their sizes may differ)"
                )
            if batch is _END:
                return
            yield batch


class _Prepared:
    """A batch's prepared output curvature, or why it failed."""

    __slots__ = ("failure", "state")

    def __init__(self, state: Any, failure: BaseException | None) -> None:
        self.state = state
        self.failure = failure


class _AgreedColumns(OutputCurvature):
    """A factor pass's output curvature, the ranks meeting once per batch after its forward and
    columns, before its backwards (NOTE [sharded Kronecker factors])."""

    def __init__(self, curvature: OutputCurvature, op: ShardedKroneckerMixin) -> None:
        self.curvature = curvature
        self.keyed = curvature.keyed
        self.columns_scale_with_output = curvature.columns_scale_with_output
        self._op = op

    def prepare(self, output: torch.Tensor, batch: Batch, key: Any) -> _Prepared:
        try:
            return _Prepared(self.curvature.prepare(output, batch, key), None)
        except Exception as exc:  # raised at the meeting, on every rank
            return _Prepared(None, exc)

    def columns(self, state: _Prepared, dtype: torch.dtype) -> tuple[int, Any]:
        failure, result = state.failure, None
        if failure is None:
            try:
                result = self.curvature.columns(state.state, dtype)
            except Exception as exc:
                failure = exc
        table = self._op._meet(failure, 0.0 if result is None else float(result[0]))
        counts = [int(c) for c in table[:, 1].tolist()]
        if len(set(counts)) > 1:
            self._op._refuse(
                f"the ranks' batches have different numbers of loss-Hessian columns ({counts}), so "
                "their backwards would not pair up in FSDP's collectives; the output curvature "
                "must give every batch the same number of columns"
            )
        assert result is not None
        return result

    def __repr__(self) -> str:
        return repr(self.curvature)


class ShardedKroneckerMixin(KroneckerDataParallelMixin, LayerKroneckerOperator):
    """Turns a KFAC-family operator into its version for a model sharded with FSDP2.

    ``class FSDPMyKFAC(ShardedKroneckerMixin, MyKFAC)`` takes ``MyKFAC``'s arguments plus
    ``process_group`` (default: the FSDP mesh's group). Each rank runs the factor passes on its
    own batches as ordinary first-order FSDP forwards and backwards, every rank the same number
    of batches (their sizes may differ), and the factors' sums are summed over the ranks as in
    :class:`KroneckerDataParallelMixin`: the factors of the union of the ranks' batches.

    The factors are **replicated**: every rank stores every layer's ``G`` and ``A`` (sharding them
    by layer is a possible later step). Vectors are **sharded** like the parameters (NOTE
    [sharded vector layout]): ``op.size`` is this rank's length, ``op.global_size`` the whole,
    ``op.layout`` this rank's shards and ``op.global_layout`` the whole parameters; pass
    ``op.backend`` (a :class:`DistributedBackend`) to the algorithms. Products, ``inverse`` and
    ``eigenvector`` gather one layer of the vector at a time (NOTE [sharded Kronecker factors]);
    ``factors``, ``eigh``, ``trace``, ``logdet`` are the whole operator's, the same on every rank.
    Monte-Carlo draws are keyed by rank, as in :class:`DDPKFACOperator`.

    Refused: selected parameters that FSDP does not shard, parameters sharded on another
    dimension than 0 (``shard_placement_fn``), 2-D meshes (HSDP), FSDP1.
    """

    _started: bool
    _layers: list[_ShardedLayer]
    global_layout: ParamLayout
    global_size: int
    backend: DistributedBackend

    def __init__(
        self, model: nn.Module, *args: Any, process_group: Any = None, **kwargs: Any
    ) -> None:
        self._fsdp_cls = _fsdp2_class(model, "DDPKFACOperator or DDPEKFACOperator")
        ranks = _join_ranks(self, _mesh_group(model, process_group), model)
        self._exchanged = False
        self._started = False
        try:
            # the KFAC operator's constructor: KroneckerDataParallelMixin's unwraps a DDP wrapper
            super(KroneckerDataParallelMixin, self).__init__(model, *args, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:
            if not self._started:  # failed before the ranks first met: meet them, flagged
                ranks.check_layout(exc, (0, 0, 0), f"construction of {type(self).__name__}")
            raise
        finally:
            for m in model.modules():  # FSDP may keep the root whole after the pass's forwards
                if isinstance(m, self._fsdp_cls):
                    m.reshard()  # type: ignore[operator]
        self._shard_vectors()

    def _start_pass(self, factor_pass: FactorPass) -> None:
        super()._start_pass(factor_pass)
        self._started = True
        failure: BaseException | None = None
        signature = (0, 0, 0)
        try:
            self._check_shards()
            signature = _layout_signature(self.layout.names, self.layout.shapes, self.dtype)
            factor_pass.source = self.source = _AgreedBatches(factor_pass.source, self)
            factor_pass.curvature = _AgreedColumns(factor_pass.curvature, self)
        except Exception as exc:
            failure = exc
        self._ranks.check_layout(failure, signature, f"construction of {type(self).__name__}")

    def _check_shards(self) -> None:
        """Every selected parameter a DTensor split by FSDP2's ``torch.chunk`` of dim 0."""
        world, rank = self.world_size, self.rank
        for name, p in self.named_params:
            if not _is_dtensor(p):
                raise TypeError(
                    f"{type(self).__name__}: parameter {name!r} is not managed by FSDP (a plain "
                    "tensor); call fully_shard on the root module too, or leave it out with "
                    "param_filter"
                )
            placements = p.placements  # type: ignore[attr-defined]
            local = tuple(_local(p).shape)
            rows = chunk_rows(p.shape[0], world)[rank]
            if (
                len(placements) != 1
                or not placements[0].is_shard(0)
                or local != (rows, *p.shape[1:])
            ):
                raise NotImplementedError(
                    f"{type(self).__name__} needs every parameter split by rows (dim 0, FSDP2's "
                    f"default); {name!r} of shape {tuple(p.shape)} is placed {placements} with a "
                    f"local shard of {local} on rank {rank} (a shard_placement_fn?)"
                )

    def _meet(self, failure: BaseException | None, value: float) -> torch.Tensor:
        """One status exchange of a factor pass (the row of KroneckerDataParallelMixin's:
        ``[failed, value]``); raises on every rank when one failed."""
        table = self._ranks.exchange([float(failure is not None), value])
        failed = [r for r in range(self.world_size) if table[r, 0] > 0]
        if failed:
            self._exchanged = True
        self._ranks.raise_for(failed, failure, "a factor pass")
        return table

    def _refuse(self, message: str) -> None:
        """Raise ``ValueError(message)`` on every rank (all of them found the same thing)."""
        self._exchanged = True
        raise ValueError(f"{type(self).__name__}: {message}")

    def _shard_vectors(self) -> None:
        """From here on vectors are this rank's shards: the layers' blocks over their whole
        parameters, and where each layer's entries sit on the ranks."""
        whole = self.layout
        local = ParamLayout.from_named([(n, _local(p)) for n, p in self.named_params])
        layers, first = [], 0
        for _, group in itertools.groupby(self._blocks, key=lambda b: b.module):
            blocks = list(group)
            indices = sorted({i for b in blocks for i in (b.weight, b.bias) if i is not None})
            shapes = [whole.shapes[i] for i in indices]
            offsets = [0, *itertools.accumulate(s.numel() for s in shapes)]
            sub = ParamLayout(
                tuple(whole.names[i] for i in indices),
                tuple(shapes),
                tuple(offsets),
                whole.dtype,
                whole.device,
            )
            public = [self._public_block(b) for b in blocks]
            op = KroneckerOperator(sub, public, damping=self.damping)
            span = range(first, first + len(blocks))
            layers.append(
                _ShardedLayer(op, span, whole, local, indices, self.rank, self.world_size)
            )
            first += len(blocks)
        self._layers = layers
        self.global_layout, self.global_size = whole, whole.size
        self.layout, self._size = local, local.size
        self.backend = DistributedBackend(self._ranks.group)

    def _public_block(self, b: Any) -> KroneckerBlock | KroneckerEigenBlock:
        """A block of the operator as the public type that :class:`KroneckerOperator` takes."""
        if b.G is not None:
            return KroneckerBlock(b.names, b.module, b.G, self._A(b), b.transposed)
        D, U_G, U_A = b.eigen
        return KroneckerEigenBlock(b.names, D, U_G, U_A, b.transposed)

    def _by_layer(
        self, V: torch.Tensor, apply: Callable[[KroneckerOperator, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``apply(layer, whole rows of V)`` per layer, this rank's rows of the result; one
        all-gather per layer."""
        k = V.shape[0]
        out = self.layout.empty(k)
        for layer in self._layers:
            mine = V.index_select(1, layer.take)
            send = V.new_zeros(k, layer.pad)
            send[:, : mine.shape[1]] = mine
            parts = V.new_empty(self.world_size, k, layer.pad)
            _torch_compat.all_gather_single(parts.view(-1), send.view(-1), group=self._ranks.group)
            whole = parts.transpose(0, 1).reshape(k, -1).index_select(1, layer.place)
            out.index_copy_(1, layer.take, apply(layer.op, whole).index_select(1, layer.mine))
        return out

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        return self._by_layer(V, lambda op, X: op._matmat_rows(X))

    def _eigen_apply(
        self, V: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return self._by_layer(V, lambda op, X: op._eigen_apply(X, fn))

    def _eigen(self) -> list[Eigen]:
        layers = getattr(self, "_layers", None)
        if layers is None:  # still in the constructor (EKFAC's bases): the whole operator's
            return super()._eigen()
        return [e for layer in layers for e in layer.op._eigen()]

    def eigenvector(self, block: int, i: int, j: int) -> torch.Tensor:
        """This rank's shard of :meth:`KroneckerOperator.eigenvector`'s ``u_G,i ⊗ u_A,j``."""
        n = self.num_blocks
        if not -n <= block < n:
            raise IndexError(f"block {block} out of range for {n} blocks")
        block %= n
        layer = next(layer for layer in self._layers if block in layer.blocks)
        whole = layer.op.eigenvector(block - layer.blocks.start, i, j)
        out = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        return out.index_copy_(0, layer.take, whole.index_select(0, layer.mine))


class FSDPKFACOperator(ShardedKroneckerMixin, KFACOperator):
    """:class:`KFACOperator` of a model sharded with FSDP2 ``fully_shard``: its arguments plus
    ``process_group``. Factors of the union of the ranks' batches, replicated on every rank;
    sharded vectors. See :class:`ShardedKroneckerMixin`."""


class FSDPEKFACOperator(ShardedKroneckerMixin, EKFACOperator):
    """:class:`EKFACOperator` of a model sharded with FSDP2 (both passes summed over the ranks;
    factors and corrected eigenvalues replicated, vectors sharded). See
    :class:`ShardedKroneckerMixin`."""
