"""Kronecker factors placed by module: each rank holds whole modules' factors and eigenbases.

A distributed Kronecker operator (``DDP*`` / ``FSDP*`` KFAC, EKFAC, KFOC) built with
``factor_placement="by_module"`` gives each factor module (a Linear, Conv2d or Conv1D) one owner
rank (:func:`assign_owners`); the owner alone keeps the module's ``G`` and ``A``, decomposes them
and applies the module's blocks. :class:`ReplicatedOwnedBlocks` are such an operator's blocks on
replicated vectors (DDP): each rank applies its own modules' blocks and one all-reduce assembles
the product on every rank. On sharded vectors (FSDP) the owner gathers its modules' pieces and
sends the result's pieces back (``sharded_kronecker``). See NOTE [Kronecker factors by module].
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hessian_eigenthings.operators.kronecker import KroneckerOperator
from hessian_eigenthings.operators.kronecker_blocks import (
    Eigen,
    KroneckerBlock,
    KroneckerEigenBlock,
    Slot,
)
from hessian_eigenthings.operators.kronecker_eigen import not_finite_message
from hessian_eigenthings.operators.ranks import RankGroup, global_rank
from hessian_eigenthings.param_utils import ParamLayout

if TYPE_CHECKING:
    from hessian_eigenthings.operators.factor_pass import FactorPass

__all__ = [
    "ModulesByOwner",
    "OwnedModule",
    "ReplicatedOwnedBlocks",
    "assign_owners",
    "factor_numels",
    "module_operators",
    "refuse_not_finite_by_module",
]

# NOTE [Kronecker factors by module]
# With factor_placement="by_module" each factor module has one owner rank. The
# assignment is a pure function of the modules' factor sizes (Σ m² + q² of G and A;
# KFOC's separate bias G adds m²), the same on every rank: largest module first, each
# to the least loaded rank (ties: the lower rank), so no rank holds more than 1/W of
# the factors plus one module. What runs where:
# - KFAC's pass runs on every rank over its own batches and makes every module's
#   sums (each sample touches every module); the sums are then reduced onto their
#   owners, one dist.reduce per rank of the sums it owns (not an all-reduce), and the
#   other ranks drop them. eigh runs on the owner only, at the first inverse, logdet,
#   eigenvalues or eigenvector: eigh time falls by about W too.
# - EKFAC's second pass rotates each rank's own samples' gradients by every module's
#   eigenbases, so every rank needs all of them while it runs: each owner decomposes its
#   modules and broadcasts (D, U_G, U_A) of each block (one broadcast per rank), the
#   corrected eigenvalues are reduced onto the owners like the factors, and the other
#   ranks' bases are dropped when the pass ends. Memory during the pass: every block's
#   U_G (m²), U_A (q²) and KFAC eigenvalues (m·q) on every rank, about the replicated
#   factors' size again (a bias alone repeats its module's U_G); after it, 1/W.
# - KFOC's power iteration alternates passes whose every product needs the other side's
#   current iterate of every module on every rank, so its sums are all-reduced as with
#   replicated factors; only the converged factors are placed by module (non-owners
#   drop theirs). Its peak memory is the replicated one; its steady state 1/W.
# Products. Replicated vectors (DDP): each rank applies its own modules' blocks into a
# zero output, and one all-reduce of [output (k·n) | W failure flags] assembles it on
# every rank (adding zeros is exact: the product is bit-identical on every rank) and
# makes a failing owner raise on all (one host sync per product, as NOTE [replicated
# product]). Sharded vectors (FSDP): per owner, one gather of its modules' pieces onto
# it and one scatter of the result's pieces back, with a failure flag (sharded_kronecker).
# trace, logdet and frobenius_norm: each owner's partial sum and one all-reduce of 1 + W
# numbers. eigenvalues(): one all-reduce of the n eigenvalues. eigh() (every eigenbasis on
# every rank) and op.factors (every factor) are refused, naming what works instead.


def assign_owners(sizes: Sequence[tuple[str, int]], world: int) -> dict[str, int]:
    """``{module: rank}``: the modules (``(name, size)``, in the model's order) largest first,
    each to the rank holding the least so far (ties: the earlier module, the lower rank)."""
    load = [0] * world
    owners: dict[str, int] = {}
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i))
    for i in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[sizes[i][0]] = rank
        load[rank] += sizes[i][1]
    return owners


def factor_numels(factor_pass: FactorPass, separate_bias_factor: bool) -> list[tuple[str, int]]:
    """``(module, numbers in its factors)``: ``G`` (``m²``), ``A`` (``q²``, a joined bias's
    column included) and, with ``separate_bias_factor`` (KFOC), a separate bias's own ``G``."""
    out = []
    for module in factor_pass.modules:
        m, q = factor_pass.matrix_shape(module)
        numel = m * m
        if module.weight is not None:
            numel += (q + int(module.joint)) ** 2
        if separate_bias_factor and module.bias is not None and not module.joint:
            numel += m * m
        out.append((module.name, numel))
    return out


@dataclass
class OwnedModule:
    """One factor module: its blocks' span in the operator, its entries' columns in the whole
    flat vector (in its own layout's order), its owner, and its blocks as an operator over its
    own parameters (on the owner only)."""

    name: str
    blocks: range
    owner: int
    indices: list[int]  # layout indices of its parameters, ascending
    cols: torch.Tensor  # (numel,) its entries' columns in the whole flat vector
    op: KroneckerOperator | None


def module_operators(
    op: KroneckerOperator, owners: dict[str, int] | None, rank: int
) -> list[OwnedModule]:
    """``op``'s blocks grouped by module (consecutive blocks of one module), each as a
    :class:`KroneckerOperator` over the module's parameters, sharing ``op``'s tensors: on every
    rank (``owners=None``) or on the module's owner only."""
    whole = op.layout
    modules, first = [], 0
    for name, group in itertools.groupby(op._blocks, key=lambda b: b.module):
        blocks = list(group)
        indices = sorted({i for b in blocks for i in (b.weight, b.bias) if i is not None})
        owner = rank if owners is None else owners[name]
        cols = torch.cat(
            [
                torch.arange(whole.offsets[i], whole.offsets[i] + whole.shapes[i].numel())
                for i in indices
            ]
        ).to(whole.device)
        sub_op = None
        if owner == rank:
            shapes = [whole.shapes[i] for i in indices]
            offsets = [0, *itertools.accumulate(s.numel() for s in shapes)]
            sub = ParamLayout(
                tuple(whole.names[i] for i in indices),
                tuple(shapes),
                tuple(offsets),
                whole.dtype,
                whole.device,
            )
            sub_op = KroneckerOperator(
                sub, [_public_block(op, b) for b in blocks], damping=op.damping
            )
        span = range(first, first + len(blocks))
        modules.append(OwnedModule(name, span, owner, indices, cols, sub_op))
        first += len(blocks)
    return modules


def _public_block(op: KroneckerOperator, b: Slot) -> KroneckerBlock | KroneckerEigenBlock:
    """A block of ``op`` as the public type that :class:`KroneckerOperator` takes."""
    if b.G is not None:
        return KroneckerBlock(b.names, b.module, b.G, op._A(b), b.transposed)
    if b.eigen is None:
        raise ValueError(f"the block over {b.names} holds no factors on this rank")
    D, U_G, U_A = b.eigen
    return KroneckerEigenBlock(b.names, D, U_G, U_A, b.transposed)


def refuse_not_finite_by_module(
    who: str, factors: Sequence[tuple[str, str, torch.Tensor | None]], agreement: RankGroup
) -> None:
    """The ``ValueError`` of ``refuse_not_finite`` on every rank, each rank checking the
    factors it holds (``None``: another rank's): one all-reduce of a flag per factor."""
    if not factors:
        return
    held = [t for _, _, t in factors if t is not None]
    device = held[0].device if held else agreement.device
    flags = torch.zeros(len(factors), dtype=torch.float64, device=device)
    for i, (_, _, t) in enumerate(factors):
        if t is not None:
            flags[i] = (~t.isfinite().all()).to(torch.float64)
    dist.all_reduce(flags, group=agreement.group)
    bad = flags.cpu().nonzero().flatten().tolist()
    if bad:
        factor, module, _ = factors[bad[0]]
        raise ValueError(not_finite_message(who, factor, module, (), len(bad) - 1))


class ModulesByOwner:
    """A Kronecker operator's modules, each held by one rank (``ranks.ModuleBlocks`` with
    ``by_module``): the reductions over the whole operator, each owner computing its part."""

    by_module = True

    def __init__(
        self,
        op: KroneckerOperator,
        owners: dict[str, int],
        agreement: RankGroup,
        modules: list[OwnedModule] | None = None,
    ) -> None:
        self.who = type(op).__name__
        self.owners = owners
        self.agreement = agreement
        self.rank, self.world = agreement.rank, agreement.world_size
        self.group = agreement.group
        self.layout = op.layout
        self.factor_dtype = op.factor_dtype
        #: every block's eigenvalue shape, in the operator's order
        self.shapes = [(b.m, b.q) for b in op._blocks]
        self.slots = op._blocks
        self.modules = modules if modules is not None else module_operators(op, owners, self.rank)

    def mine(self) -> list[OwnedModule]:
        return [m for m in self.modules if m.op is not None]

    def _flags(self, flat: torch.Tensor, failure: BaseException | None, what: str) -> None:
        """All-reduce ``flat``, whose last ``W`` entries are the ranks' failure flags (this
        rank's set when ``failure``); raise on every rank if any is set (one host sync)."""
        if failure is not None:
            flat[flat.numel() - self.world + self.rank] = 1.0
        dist.all_reduce(flat, group=self.group)
        flags = flat[flat.numel() - self.world :].cpu()
        failed = [r for r in range(self.world) if flags[r] > 0]
        self.agreement.raise_failed(failed, failure, what)

    def total(self, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(1 + self.world, dtype=torch.float64, device=self.layout.device)
        failure: BaseException | None = None
        try:
            for module in self.mine():
                flat[0] += fn(module.op).to(torch.float64)
        except Exception as exc:
            failure = exc
        self._flags(flat, failure, f"a reduction of {self.who}")
        return flat[0].to(self.factor_dtype)

    def eigenvalues(self) -> list[torch.Tensor]:
        sizes = [m * q for m, q in self.shapes]
        offsets = [0, *itertools.accumulate(sizes)]
        flat = torch.zeros(
            offsets[-1] + self.world, dtype=self.factor_dtype, device=self.layout.device
        )
        failure: BaseException | None = None
        try:
            for module in self.mine():
                for b, (D, _, _) in zip(module.blocks, module.op._eigen(), strict=True):  # type: ignore[union-attr]
                    flat[offsets[b] : offsets[b + 1]] = D.reshape(-1)
        except Exception as exc:
            failure = exc
        self._flags(flat, failure, f"the eigenvalues of {self.who}")
        return [
            flat[offsets[b] : offsets[b + 1]].view(m, q) for b, (m, q) in enumerate(self.shapes)
        ]

    def eigen(self) -> list[Eigen]:
        raise ValueError(
            f"{self.who} with factor_placement='by_module' keeps each module's eigenbases on one "
            "rank (op.factor_owners): op.eigenvalues() gives every eigenvalue on every rank and "
            "op.eigenvector(block, i, j) one eigenvector, or build the operator with "
            "factor_placement='replicated'"
        )

    def shared_bases(self) -> list[Eigen]:
        """``(D, U_G, U_A)`` of every block on every rank, from its owner (one broadcast per
        rank that owns modules): EKFAC's second pass (NOTE [Kronecker factors by module])."""
        device = self.layout.device
        bases: list[Eigen | None] = [None] * len(self.shapes)
        flags: list[torch.Tensor] = []
        failure: BaseException | None = None
        for r in range(self.world):
            modules = [m for m in self.modules if m.owner == r]
            if not modules:
                continue
            blocks = [b for m in modules for b in m.blocks]
            sizes = [(m * q, m * m, q * q) for m, q in (self.shapes[b] for b in blocks)]
            flat = torch.zeros(sum(map(sum, sizes)) + 1, dtype=self.factor_dtype, device=device)
            if r == self.rank:
                try:
                    own = [e for m in modules for e in m.op._eigen()]  # type: ignore[union-attr]
                    at = 0
                    for b, (D, U_G, U_A) in zip(blocks, own, strict=True):
                        for t in (D, U_G, U_A):
                            flat[at : at + t.numel()] = t.reshape(-1)
                            at += t.numel()
                        bases[b] = (D, U_G, U_A)  # the owner keeps its own tensors
                except Exception as exc:
                    failure = exc
                    flat[-1] = 1.0
            dist.broadcast(flat, global_rank(self.group, r), group=self.group)
            flags.append(flat[-1])
            if r != self.rank:
                at = 0
                for b, (dm, dg, da) in zip(blocks, sizes, strict=True):
                    m, q = self.shapes[b]
                    D = flat[at : at + dm].view(m, q)
                    U_G = flat[at + dm : at + dm + dg].view(m, m)
                    U_A = flat[at + dm + dg : at + dm + dg + da].view(q, q)
                    bases[b] = (D, U_G, U_A)
                    at += dm + dg + da
        if flags:
            state = torch.stack(flags).cpu()
            owners = [r for r in range(self.world) if any(m.owner == r for m in self.modules)]
            failed = [r for r, f in zip(owners, state.tolist(), strict=True) if f > 0]
            self.agreement.raise_failed(failed, failure, f"the eigenbases of {self.who}")
        return [b for b in bases if b is not None]


class ReplicatedOwnedBlocks(ModulesByOwner):
    """:class:`ModulesByOwner` on replicated vectors (DDP): each rank applies its own modules'
    blocks, one all-reduce assembles the result on every rank (NOTE [Kronecker factors by
    module])."""

    def apply(
        self, V: torch.Tensor, fn: Callable[[KroneckerOperator, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        k, n = V.shape
        flat = V.new_zeros(k * n + self.world)
        out = flat[: k * n].view(k, n)
        failure: BaseException | None = None
        try:
            for module in self.mine():
                X = V.index_select(1, module.cols)
                out.index_copy_(1, module.cols, fn(module.op, X).to(V.dtype))  # type: ignore[arg-type]
        except Exception as exc:
            failure = exc
        self._flags(flat, failure, f"a product of {self.who}")
        return out

    def eigenvector(self, block: int, i: int, j: int) -> torch.Tensor:
        module = next(m for m in self.modules if block in m.blocks)
        n = self.layout.size
        flat = torch.zeros(n + self.world, dtype=self.layout.dtype, device=self.layout.device)
        failure: BaseException | None = None
        if module.op is not None:
            try:
                whole = module.op.eigenvector(block - module.blocks.start, i, j)
                flat.index_copy_(0, module.cols, whole)
            except Exception as exc:
                failure = exc
        self._flags(flat, failure, f"an eigenvector of {self.who}")
        return flat[:n]
