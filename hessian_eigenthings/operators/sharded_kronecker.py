"""Kronecker factors of a model sharded with FSDP2: factors replicated or placed by module,
sharded vectors.

The factor pass is first-order FSDP forwards and backwards on each rank's batches, the factor
sums all-reduced as for replicated ranks (``ranks.Replicated.sum_factors``): factors replicated
on every rank, vectors sharded; or, with ``factor_placement="by_module"``, each module's sums
reduced onto one owner rank that alone keeps them (NOTE [Kronecker factors by module] in
``factor_owners``). :class:`ShardedFactors` are the ranks of such an operator: the sharded
ranks, meeting before each batch of a factor pass and between its forward and its backwards.
Cost per product: replicated factors, one all-gather per factor module (a Linear, Conv2d or
Conv1D) of its ``k`` vectors' pieces and the module's block products on its whole parameters;
by module, per owner rank one gather of its modules' pieces onto it and one scatter of the
results' pieces back. See NOTE [sharded Kronecker factors].
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.batching import Batch, BatchSource, batch_size
from hessian_eigenthings.linalg_distributed import DistributedBackend
from hessian_eigenthings.loss_fns.output_curvature import OutputCurvature
from hessian_eigenthings.operators.factor_owners import (
    ModulesByOwner,
    OwnedModule,
    module_operators,
)
from hessian_eigenthings.operators.factor_pass import FactorPass
from hessian_eigenthings.operators.kfac import EKFACOperator, KFACOperator, ModuleKroneckerOperator
from hessian_eigenthings.operators.kfoc import KFOCOperator
from hessian_eigenthings.operators.kronecker import KroneckerOperator
from hessian_eigenthings.operators.kronecker_blocks import Eigen
from hessian_eigenthings.operators.ranks import (
    FactorPlacement,
    RankGroup,
    check_factor_placement,
    global_rank,
    is_dtensor,
    layout_signature,
    local_shard,
)
from hessian_eigenthings.operators.sharded import Sharded
from hessian_eigenthings.operators.sharded_walk import chunk_rows
from hessian_eigenthings.param_utils import ParamLayout

__all__ = [
    "FSDPEKFACOperator",
    "FSDPKFACOperator",
    "FSDPKFOCOperator",
    "ShardedFactors",
    "ShardedKroneckerMixin",
]

# NOTE [sharded Kronecker factors]
# Factors. FSDP2 shards parameters, never activations: inside a fully_shard'ed
# module's forward its factor modules run on whole (gathered) weights, so the
# factor pass's hooks see each module's whole input and, in the backward to the
# modules' outputs, the whole output gradients of this rank's samples. The pass is the
# single-process pass on this rank's batches (the tests check it against
# KFACOperator on the union of the ranks' batches), run as ordinary
# first-order FSDP forwards and backwards (to the module outputs: no parameter
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
# Products. The factors are replicated: every rank holds every module's G and A
# (Σ m² + q² numbers, as one process; sharding the modules' factors over the
# ranks is a possible later step). Vectors are sharded (NOTE [sharded vector
# layout]). Per factor module and product: one all-gather of the module's pieces
# of the k vectors (each rank's rows padded to FSDP's chunk and packed; a rank's
# piece may be short or empty: FSDP2's torch.chunk split of dim 0), the module's
# blocks applied to its whole parameters as in one process (a Conv2d kernel
# flattened, a Conv1D weight transposed, a bias joined or alone, whichever
# factor dim 0 meets), and this rank's rows kept. A rank holds at most one
# module's k vectors whole; the blocks' arithmetic (two small matrix products
# each) is repeated on every rank.
#
# By module (factor_placement="by_module", NOTE [Kronecker factors by module]):
# each rank owns whole modules' factors. Per product, for each rank r owning
# modules: every rank sends r its pieces of r's modules (one gather, each rank's
# pieces padded to the module's chunk as above), r applies its modules' blocks on
# the whole parameters, and sends each rank its rows of the result with a failure
# flag (one scatter); the flags are read once at the end (one host sync), and a
# failing owner raises on every rank. r holds its modules' k vectors whole; the
# blocks' arithmetic is done once, on the owner.


class _ShardedModule:
    """One factor module's blocks over its whole parameters, and where its entries sit on the
    ranks.

    ``take``: the columns of this rank's vector holding its rows of the module, in the module's
    order; ``mine``: the same entries' columns in the module's whole vector; ``place``: each whole
    entry's column in the gathered pieces (``W`` pieces of ``pad`` columns, rank after rank).
    ``op`` is ``None`` on the ranks that do not own the module (factors by module)."""

    def __init__(
        self,
        op: KroneckerOperator | None,
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
        offset = 0  # the parameter's offset in the module's whole vector
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

    def __init__(self, source: BatchSource, agreement: RankGroup, who: str) -> None:
        super().__init__(
            source.dataloader,
            full_dataset=source.full_dataset,
            num_batches=source.num_batches,
            device=source.device,
        )
        self.agreement, self.who = agreement, who

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
            table = self.agreement.agree(failure, state, what="a factor pass")
            states = table[:, 0].tolist()
            if len(set(states)) > 1:
                what = {0.0: "no batch left", 1.0: "a batch", 2.0: "an empty batch"}
                seen = "; ".join(f"rank {r}: {what[s]}" for r, s in enumerate(states))
                self.agreement.refuse(
                    f"{self.who}: at batch {position} the ranks differ ({seen}). FSDP's forward and backward "
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

    def __init__(self, curvature: OutputCurvature, agreement: RankGroup, who: str) -> None:
        self.curvature = curvature
        self.keyed = curvature.keyed
        self.columns_scale_with_output = curvature.columns_scale_with_output
        self.agreement, self.who = agreement, who

    def prepare(self, output: torch.Tensor, batch: Batch, key: Any) -> _Prepared:
        try:
            return _Prepared(self.curvature.prepare(output, batch, key), None)
        except Exception as exc:  # raised at the meeting, on every rank
            return _Prepared(None, exc)

    def columns(self, state: _Prepared, dtype: torch.dtype) -> tuple[int, Any]:
        return self._agreed(state, lambda inner: self.curvature.columns(inner, dtype))

    def row_columns(self, state: _Prepared, dtype: torch.dtype) -> tuple[int, Any]:
        return self._agreed(state, lambda inner: self.curvature.row_columns(inner, dtype))

    def _agreed(
        self, state: _Prepared, make: Callable[[Any], tuple[int, Any]]
    ) -> tuple[int, Any]:
        failure, result = state.failure, None
        if failure is None:
            try:
                result = make(state.state)
            except Exception as exc:
                failure = exc
        table = self.agreement.agree(
            failure, 0.0 if result is None else float(result[0]), what="a factor pass"
        )
        counts = [int(c) for c in table[:, 0].tolist()]
        if len(set(counts)) > 1:
            self.agreement.refuse(
                f"{self.who}: the ranks' batches have different numbers of loss-Hessian columns ({counts}), so "
                "their backwards would not pair up in FSDP's collectives; the output curvature "
                "must give every batch the same number of columns"
            )
        if result is None:
            raise InternalError("result is not None")
        return result

    def __repr__(self) -> str:
        return repr(self.curvature)


class ShardedFactors(Sharded):
    """:class:`~hessian_eigenthings.operators.sharded.Sharded` ranks of a Kronecker operator:
    a factor pass's batches and output curvature agreed on (NOTE [sharded Kronecker factors]),
    every selected parameter checked to be split by FSDP2's rows. ``factor_placement``: the
    factors on every rank (``"replicated"``) or each module's on one rank (``"by_module"``)."""

    def __init__(
        self,
        model: nn.Module,
        process_group: Any = None,
        replicated: str = "DDPKFACOperator",
        *,
        factor_placement: FactorPlacement = "replicated",
    ) -> None:
        placement = check_factor_placement(factor_placement)
        super().__init__(model, process_group, replicated)
        self.factor_placement = placement

    def start_factor_pass(self, factor_pass: FactorPass) -> None:
        super().start_factor_pass(factor_pass)
        self.started = True
        who = factor_pass.who
        failure: BaseException | None = None
        signature = (0, 0, 0)
        try:
            self._check_shards(who, factor_pass.named_params)
            layout = factor_pass.layout
            signature = layout_signature(layout.names, layout.shapes, layout.dtype)
            factor_pass.source = _AgreedBatches(factor_pass.source, self.agreement, who)
            factor_pass.curvature = _AgreedColumns(factor_pass.curvature, self.agreement, who)
        except Exception as exc:
            failure = exc
        self.agreement.check_layout(failure, signature, f"construction of {who}")

    def _check_shards(self, who: str, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Every selected parameter a DTensor split by FSDP2's ``torch.chunk`` of dim 0."""
        world, rank = self.world_size, self.rank
        for name, p in named_params:
            if not is_dtensor(p):
                raise TypeError(
                    f"{who}: parameter {name!r} is not managed by FSDP (a plain "
                    "tensor); call fully_shard on the root module too, or leave it out with "
                    "param_filter"
                )
            placements = p.placements  # type: ignore[attr-defined]
            local = tuple(local_shard(p).shape)
            rows = chunk_rows(p.shape[0], world)[rank]
            if (
                len(placements) != 1
                or not placements[0].is_shard(0)
                or local != (rows, *p.shape[1:])
            ):
                raise NotImplementedError(
                    f"{who} needs every parameter split by rows (dim 0, FSDP2's "
                    f"default); {name!r} of shape {tuple(p.shape)} is placed {placements} with a "
                    f"local shard of {local} on rank {rank} (a shard_placement_fn?)"
                )


class _ShardedBlocks:
    """A Kronecker operator's blocks on sharded vectors (``ranks.ModuleBlocks``): one module's
    blocks at a time, on its whole parameters, its pieces of the vectors gathered from the
    ranks (NOTE [sharded Kronecker factors])."""

    def __init__(self, modules: list[_ShardedModule], local: ParamLayout, group: Any) -> None:
        self.modules, self.local, self.group = modules, local, group
        self.world = dist.get_world_size(group)

    def apply(
        self, V: torch.Tensor, fn: Callable[[KroneckerOperator, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn(module's operator, whole rows of V)`` per module, this rank's rows of the result;
        one all-gather per module."""
        k = V.shape[0]
        out = self.local.empty(k)
        for module in self.modules:
            mine = V.index_select(1, module.take)
            send = V.new_zeros(k, module.pad)
            send[:, : mine.shape[1]] = mine
            parts = V.new_empty(self.world, k, module.pad)
            _torch_compat.all_gather_single(parts.view(-1), send.view(-1), group=self.group)
            whole = parts.transpose(0, 1).reshape(k, -1).index_select(1, module.place)
            out.index_copy_(1, module.take, fn(module.op, whole).index_select(1, module.mine))  # type: ignore[arg-type]
        return out

    by_module = False

    def _ops(self) -> list[KroneckerOperator]:
        return [module.op for module in self.modules if module.op is not None]

    def eigen(self) -> list[Eigen]:
        return [e for op in self._ops() for e in op._eigen()]

    def eigenvector(self, block: int, i: int, j: int) -> torch.Tensor:
        """This rank's shard of :meth:`KroneckerOperator.eigenvector`'s ``u_G,i ⊗ u_A,j``."""
        module = next(module for module in self.modules if block in module.blocks)
        if module.op is None:
            raise InternalError("a replicated factor's module has its operator on every rank")
        whole = module.op.eigenvector(block - module.blocks.start, i, j)
        out = torch.zeros(self.local.size, dtype=self.local.dtype, device=self.local.device)
        return out.index_copy_(0, module.take, whole.index_select(0, module.mine))

    def total(self, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        return torch.stack([fn(op) for op in self._ops()]).sum()

    def eigenvalues(self) -> list[torch.Tensor]:
        return [D for D, _, _ in self.eigen()]


class _ShardedOwnedBlocks(ModulesByOwner):
    """A Kronecker operator's blocks on sharded vectors, each module's factors on its owner
    (NOTE [sharded Kronecker factors], by module): per owner, one gather of its modules'
    pieces and one scatter of the results' pieces."""

    def __init__(
        self,
        op: KroneckerOperator,
        owners: dict[str, int],
        agreement: RankGroup,
        pieces: list[_ShardedModule],
        local: ParamLayout,
        modules: list[OwnedModule],
    ) -> None:
        super().__init__(op, owners, agreement, modules)
        self.pieces, self.local = pieces, local

    def _scatter(
        self, owner: int, results: torch.Tensor | None, width: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """This rank's row of ``results`` ``(W, width + 1)`` (on ``owner``; the last column the
        failure flag), scattered from ``owner``."""
        recv = torch.empty(width + 1, dtype=dtype, device=self.local.device)
        rows = list(results.unbind(0)) if results is not None else None
        dist.scatter(recv, rows, src=global_rank(self.group, owner), group=self.group)
        return recv

    def apply(
        self, V: torch.Tensor, fn: Callable[[KroneckerOperator, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``fn(module's operator, whole rows of V)`` per module on its owner, this rank's rows
        of the result; per owner one gather and one scatter."""
        k, W = V.shape[0], self.world
        out = self.local.empty(k)
        failure: BaseException | None = None
        flags, seen = [], []
        for r in range(W):
            pairs = [(m, p) for m, p in zip(self.modules, self.pieces, strict=True) if m.owner == r]
            if not pairs:
                continue
            width = sum(p.pad for _, p in pairs)
            send = V.new_zeros(k, width)
            at = 0
            for _, p in pairs:
                send[:, at : at + p.take.numel()] = V.index_select(1, p.take)
                at += p.pad
            parts = [V.new_empty(k, width) for _ in range(W)] if r == self.rank else None
            dist.gather(send, parts, dst=global_rank(self.group, r), group=self.group)
            results = None
            if parts is not None:
                results = V.new_zeros(W, k * width + 1)
                try:
                    stacked = torch.stack(parts)  # (W, k, width)
                    pieces = V.new_zeros(W, k, width)
                    at = 0
                    for m, p in pairs:
                        whole = stacked[:, :, at : at + p.pad].transpose(0, 1).reshape(k, -1)
                        Y = fn(m.op, whole.index_select(1, p.place))  # type: ignore[arg-type]
                        placed = V.new_zeros(k, W * p.pad).index_copy_(1, p.place, Y.to(V.dtype))
                        pieces[:, :, at : at + p.pad] = placed.view(k, W, p.pad).transpose(0, 1)
                        at += p.pad
                    results[:, :-1] = pieces.reshape(W, -1)
                except Exception as exc:
                    failure = exc
                    results[:, -1] = 1.0
            recv = self._scatter(r, results, k * width, V.dtype)
            flags.append(recv[-1])
            seen.append(r)
            got = recv[:-1].view(k, width)
            at = 0
            for _, p in pairs:
                out.index_copy_(1, p.take, got[:, at : at + p.take.numel()])
                at += p.pad
        self._raise_flagged(seen, flags, failure, f"a product of {self.who}")
        return out

    def _raise_flagged(
        self,
        owners: list[int],
        flags: list[torch.Tensor],
        failure: BaseException | None,
        what: str,
    ) -> None:
        """Raise on every rank when an owner flagged a failure (one host sync)."""
        if not flags:
            return
        state = torch.stack(flags).cpu().tolist()
        failed = [r for r, f in zip(owners, state, strict=True) if f > 0]
        self.agreement.raise_failed(failed, failure, what)

    def eigenvector(self, block: int, i: int, j: int) -> torch.Tensor:
        """This rank's shard of ``u_G,i ⊗ u_A,j``, made on the module's owner and scattered."""
        at = next(n for n, m in enumerate(self.modules) if block in m.blocks)
        module, piece = self.modules[at], self.pieces[at]
        dtype, W = self.local.dtype, self.world
        failure: BaseException | None = None
        results = None
        if module.op is not None:
            results = torch.zeros(W, piece.pad + 1, dtype=dtype, device=self.local.device)
            try:
                whole = module.op.eigenvector(block - module.blocks.start, i, j)
                placed = whole.new_zeros(W * piece.pad).index_copy_(0, piece.place, whole)
                results[:, :-1] = placed.view(W, piece.pad)
            except Exception as exc:
                failure = exc
                results[:, -1] = 1.0
        recv = self._scatter(module.owner, results, piece.pad, dtype)
        self._raise_flagged([module.owner], [recv[-1]], failure, f"an eigenvector of {self.who}")
        out = torch.zeros(self.local.size, dtype=dtype, device=self.local.device)
        return out.index_copy_(0, piece.take, recv[: piece.take.numel()])


class ShardedKroneckerMixin(ModuleKroneckerOperator):
    """Turns a KFAC-family operator into its version for a model sharded with FSDP2.

    ``class FSDPMyKFAC(ShardedKroneckerMixin, MyKFAC)`` takes ``MyKFAC``'s arguments plus
    ``process_group`` (default: the FSDP mesh's group). Each rank runs the factor passes on its
    own batches as ordinary first-order FSDP forwards and backwards, every rank the same number
    of batches (their sizes may differ), and the factors' sums are summed over the ranks as in
    :class:`KroneckerDataParallelMixin`: the factors of the union of the ranks' batches.

    ``factor_placement``: ``"replicated"`` (default): every rank stores every module's ``G`` and
    ``A``. ``"by_module"``: each module's factors on one owner rank (``op.factor_owners``), which
    alone decomposes them and applies their blocks; as in :class:`KroneckerDataParallelMixin`,
    ``eigh()``, ``factors`` and EKFAC's ``corrected_eigenvalues`` are then refused and
    ``eigenvalues()``, ``eigenvector``, ``trace``, ``logdet``, ``frobenius_norm`` and
    ``owned_factors`` work (NOTE [Kronecker factors by module]). Vectors are **sharded** like the parameters (NOTE
    [sharded vector layout]): ``op.size`` is this rank's length, ``op.global_size`` the whole,
    ``op.layout`` this rank's shards and ``op.global_layout`` the whole parameters; pass
    ``op.backend`` (a :class:`DistributedBackend`) to the algorithms. Products, ``inverse`` and
    ``eigenvector`` gather one factor module of the vector at a time (NOTE [sharded Kronecker factors]);
    ``factors``, ``eigh``, ``trace``, ``logdet`` are the whole operator's, the same on every rank
    (every rank calls each method together: they are collectives).
    Monte-Carlo draws are keyed by rank, as in :class:`DDPKFACOperator`.

    Refused: selected parameters that FSDP does not shard, parameters sharded on another
    dimension than 0 (``shard_placement_fn``), 2-D meshes (HSDP), FSDP1.
    """

    ranks: ShardedFactors
    global_layout: ParamLayout
    global_size: int
    backend: DistributedBackend

    def __init__(
        self,
        model: nn.Module,
        *args: Any,
        process_group: Any = None,
        factor_placement: FactorPlacement = "replicated",
        **kwargs: Any,
    ) -> None:
        ranks = ShardedFactors(
            model,
            process_group,
            type(self).__name__.replace("FSDP", "DDP", 1),
            factor_placement=factor_placement,
        )
        try:
            super().__init__(model, *args, ranks=ranks, **kwargs)  # type: ignore[arg-type, call-arg]
        except Exception as exc:
            if not ranks.started:  # failed before the ranks first met: meet them, flagged
                ranks.agreement.check_layout(
                    exc, (0, 0, 0), f"construction of {type(self).__name__}"
                )
            raise
        finally:
            ranks.reshard(model)  # FSDP may keep the root whole after the pass's forwards
        self._shard_vectors()

    def _shard_vectors(self) -> None:
        """From here on vectors are this rank's shards: the modules' blocks over their whole
        parameters (on their owners only, by module), and where each module's entries sit on
        the ranks."""
        whole = self.layout
        local = ParamLayout.from_named([(n, local_shard(p)) for n, p in self.named_params])
        rank, world = self.ranks.rank, self.ranks.world_size
        modules = module_operators(self, self._owners, rank)
        pieces = [
            _ShardedModule(m.op, m.blocks, whole, local, m.indices, rank, world) for m in modules
        ]
        if self._owners is None:
            self.ranks.module_blocks = _ShardedBlocks(pieces, local, self.ranks.group)
        else:
            self.ranks.module_blocks = _ShardedOwnedBlocks(
                self, self._owners, self.ranks.agreement, pieces, local, modules
            )
        self.global_layout, self.global_size = whole, whole.size
        self.layout, self._size = local, local.size
        self.backend = DistributedBackend(self.ranks.group)


class FSDPKFACOperator(ShardedKroneckerMixin, KFACOperator):
    """:class:`KFACOperator` of a model sharded with FSDP2 ``fully_shard``: its arguments plus
    ``process_group`` and ``factor_placement``. Factors of the union of the ranks' batches,
    replicated on every rank or placed by module; sharded vectors. See
    :class:`ShardedKroneckerMixin`."""


class FSDPEKFACOperator(ShardedKroneckerMixin, EKFACOperator):
    """:class:`EKFACOperator` of a model sharded with FSDP2 (both passes summed over the ranks;
    factors and corrected eigenvalues replicated or placed by module, vectors sharded). See
    :class:`ShardedKroneckerMixin`."""


class FSDPKFOCOperator(ShardedKroneckerMixin, KFOCOperator):
    """:class:`KFOCOperator` of a model sharded with FSDP2: its arguments plus ``process_group``
    and ``factor_placement``; every pass of the power iteration is first-order FSDP forwards
    and backwards on each rank's batches (every rank the same number), its sums summed over the
    ranks; Monte-Carlo draws keyed by rank as in :class:`DDPKFOCOperator`. See
    :class:`ShardedKroneckerMixin`."""
