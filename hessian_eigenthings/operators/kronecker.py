"""Block-diagonal Kronecker-factored operators, built from their factors.

``K = blockdiag_b(G_b ⊗ A_b) + λ I`` over a flat parameter vector. Block ``b`` covers one or two
parameters and reads them as a matrix ``X (m, q)``: the first parameter's rows (a tensor of
more than two dimensions flattened to ``(m, rest)``, as a conv weight ``(out, in·kh·kw)``; with
``transposed`` a matrix stored ``(in, out)``, HuggingFace's ``Conv1D``, read as its transpose),
then a second, one-dimensional parameter of size ``m`` (a bias) as a last column. A single
one-dimensional parameter is ``X (m, 1)`` (a bias alone, ``A = [[1]]``). With ``vec`` row-major,
as in the flat vector, ``(G ⊗ A) vec(X) = vec(G X A)`` for a symmetric ``A``.

Eigendecomposition: with ``G = U_G Λ_G U_Gᵀ`` and ``A = U_A Λ_A U_Aᵀ`` the block's eigenvalues
are ``λ_G,i λ_A,j`` with eigenvectors ``u_G,i ⊗ u_A,j`` (the matrix ``u_G,i u_A,jᵀ`` in the
block's parameters). A block may instead be given in such an eigenbasis with eigenvalues of its
own, ``U diag(D) Uᵀ`` with ``U = U_G ⊗ U_A`` and ``D (m, q)`` (EKFAC's form). Every matrix
function is then exact and block by block: ``(K + λI)⁻¹``, ``log det(K + λI)``.

Cost: a product is two small matrix products per block (four in eigenbasis form); ``eigh``,
``inverse`` and ``logdet`` decompose each distinct factor once (a factor shared by two blocks,
a module's ``G`` for its weight and its bias, once), cached; ``trace`` and ``frobenius_norm`` of
factored blocks need no decomposition (``tr(G)·tr(A)``, ``‖G‖_F·‖A‖_F``).

Shape: the blocks and how they read the flat vector are :mod:`~hessian_eigenthings.operators.
kronecker_blocks`; the cached eigendecompositions are :mod:`~hessian_eigenthings.operators.
kronecker_eigen`; this module is the operator's algebra on them.

NOTE [eigenvalues at the rounding level]: a singular factor's zero eigenvalues come out of
``eigh`` as rounding noise of either sign (``±1e-16·‖G‖`` in float64), whose inverses are huge
finite numbers and whose logarithms are ``nan``. So an eigenvalue ``λ`` of an ``n × n`` factor
with ``|λ| <= n·eps·max|λ|`` (``eps`` of the factors' dtype: the rank tolerance of
``torch.linalg.matrix_rank``) is exactly zero, and so are the block's eigenvalues ``λ_G λ_A``
it is a factor of. A block given in its eigenbasis (EKFAC's corrected eigenvalues: means of
squared projections, non-negative and exact to their own rounding, not ``eigh``'s output) takes
``n = max(m, q)``, its own largest eigenvalue and the square of that tolerance, ``(n·eps)²``:
a null direction of ``G`` gets a corrected eigenvalue of ``≈ eps²`` of the largest, while the
real ones may sit far below ``n·eps`` (measured: zeroing GPT-2 EKFAC's below ``n·eps`` in float32
made its float32 influence scores 16× off in norm; with ``(n·eps)²``, 1% from float64, the conditioning's
share); its negative eigenvalues down to ``-n·eps·max`` are zero too. Without damping such a block
is singular: ``eigh`` reports ``0``, ``logdet`` is ``-inf``, ``inverse()`` is refused; with a
damping ``λ`` the inverse there is ``1/λ``, however small ``λ``. In float32 the tolerance is
about ``1e-4`` of the largest eigenvalue for a factor of a thousand rows: smaller eigenvalues need
float64 factors (a float64 model). An eigenvalue below ``-tolerance`` (a factor that is not
positive semi-definite) is kept: ``logdet`` is then ``nan``.

NOTE [factors changed in place]: the factors are not copied (but inference tensors, which keep
no version counter, are: see below), so a change in place (``G.mul_(2)``, an optimizer's running
average) is seen by products and ``trace`` at once; the cached eigendecompositions behind
``eigh``, ``inverse``, ``logdet`` and ``eigenvector`` remember the factors' version counters
(``tensor._version``, Python integers: no device work) and are recomputed, for the changed
factors only, at their next use. An operator from ``inverse()`` follows too. Factors made under
``torch.inference_mode`` have no version counter: ``KroneckerOperator`` copies them at
construction, so a later change to the caller's tensor is seen by nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.operators.kronecker_blocks import (
    Block,
    Eigen,
    KroneckerBlock,
    KroneckerEigenBlock,
    Slot,
    checked_blocks,
    gather,
    scatter,
)
from hessian_eigenthings.operators.kronecker_eigen import FactorDecompositions
from hessian_eigenthings.operators.protocol import CurvatureOperator
from hessian_eigenthings.operators.ranks import LOCAL, ModuleBlocks, Ranks
from hessian_eigenthings.param_utils import ParamLayout

__all__ = [
    "KroneckerBlock",
    "KroneckerEigen",
    "KroneckerEigenBlock",
    "KroneckerOperator",
]


@dataclass(frozen=True)
class KroneckerEigen:
    """Eigendecomposition of a Kronecker-factored operator, block by block.

    The eigenvector of ``blocks[b].eigenvalues[i, j]`` is ``u_G,i ⊗ u_A,j`` laid
    out in the block's parameters (zero elsewhere): ``op.eigenvector(b, i, j)``."""

    blocks: tuple[KroneckerEigenBlock, ...]

    def _all(self) -> torch.Tensor:
        return torch.cat([b.eigenvalues.reshape(-1) for b in self.blocks])

    @property
    def eigenvalues(self) -> torch.Tensor:  # (n,) every eigenvalue, ascending
        return self._all().sort(stable=True).values

    def locate(self, index: int) -> tuple[int, int, int]:
        """``(block, i, j)`` of ``eigenvalues[index]`` (negative counts from the largest)."""
        flat = self._all()
        n = flat.shape[0]
        if not -n <= index < n:
            raise IndexError(f"eigenvalue index {index} out of range for {n} eigenvalues")
        at = int(flat.sort(stable=True).indices[index])
        for b, block in enumerate(self.blocks):
            count = block.eigenvalues.numel()
            if at < count:
                q = block.eigenvalues.shape[1]
                return b, at // q, at % q
            at -= count
        raise AssertionError("unreachable: the index lies in some block")


def check_damping(damping: object) -> float:
    value = float(damping)  # type: ignore[arg-type]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
    return value


class KroneckerOperator(CurvatureOperator):
    """A block-diagonal operator ``blockdiag(G_b ⊗ A_b) + damping·I`` from its factors.

    ``KroneckerOperator(layout, blocks, *, damping=0.0)``:

    - ``layout``: the flat vector's parameters in order: a :class:`ParamLayout`, a dict of
      tensors (``dict(model.named_parameters())``: their dtype and device) or of shapes
      (``{"fc.weight": (3, 4), "fc.bias": (3,)}``: the factors' dtype and device).
    - ``blocks``: :class:`KroneckerBlock` ``(names, module, G, A)`` or, for a block known in its
      eigenbasis, :class:`KroneckerEigenBlock`; each parameter of ``layout`` in exactly one
      block. The module docstring says how a block reads its parameters.
    - ``damping``: ``λ >= 0`` added to the diagonal: the operator is ``K + λI``.

    Products and every method below are exact. The factors must be symmetric (positive
    semi-definite for ``logdet`` and the meaning of ``inverse``); eigenvalues within rounding of
    zero count as zero (NOTE [eigenvalues at the rounding level]: ``logdet`` ``-inf`` and
    ``inverse()`` refused for a singular operator without damping). The factors are not copied:
    a change in place is followed by every method, the cached decompositions included (NOTE
    [factors changed in place]; inference tensors are copied). A factor holding NaN or inf is
    refused, naming its module, when it is decomposed. The operator's dtype is the layout's, its
    factors' may be wider (products are computed in the factors' dtype).
    """

    #: the processes the vectors are spread over (``operators.ranks``): one by default. Sharded
    #: ranks hold vectors in pieces: products, ``_eigen`` and eigenvectors go through their
    #: ``module_blocks`` (``operators.sharded_kronecker``), one module's blocks at a time
    ranks: Ranks = LOCAL

    def __init__(
        self,
        layout: ParamLayout | Mapping[str, torch.Tensor | Sequence[int]],
        blocks: Sequence[Block],
        *,
        damping: float = 0.0,
    ) -> None:
        lay, slots = checked_blocks(layout, blocks)
        self._init_blocks(lay, slots, check_damping(damping))

    # -- for subclasses that build their blocks from a model (KFAC, EKFAC, KFOC) -----------------
    def _init_blocks(
        self,
        layout: ParamLayout,
        blocks: list[Slot],
        damping: float = 0.0,
        factor_dtype: torch.dtype | None = None,
    ) -> None:
        """Trusted blocks (no checks; the factor path adds no kernel: a bias alone keeps ``A``
        unset until it is read). ``factor_dtype``: given where a block may hold nothing (factors
        by module: another rank's module)."""
        self.layout = layout
        self._size, self._device, self._dtype = layout.size, layout.device, layout.dtype
        self._blocks = blocks
        self.damping = damping
        if factor_dtype is None:
            first = blocks[0]
            factor = first.G if first.G is not None else first.eigen[0]  # type: ignore[index]
            factor_dtype = factor.dtype
        #: factors and reductions run in this dtype (float32 or wider in the KFAC family)
        self.factor_dtype: torch.dtype = factor_dtype
        #: the blocks' eigendecompositions, cached (NOTE [factors changed in place])
        self._decompositions = FactorDecompositions(blocks, type(self).__name__)

    def _A(self, block: Slot) -> torch.Tensor:
        """The block's ``A`` (``[[1]]`` for a bias alone)."""
        return self._decompositions.A(block)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def factors(self) -> tuple[KroneckerBlock, ...]:
        """The blocks ``G ⊗ A`` in the order of the flat vector's parameters."""
        self._refuse_by_module("factors", "op.owned_factors gives this rank's modules' blocks")
        return self._public_factors(self._factor_slots())

    @property
    def owned_factors(self) -> tuple[KroneckerBlock, ...]:
        """The blocks ``G ⊗ A`` this rank holds: every block (:attr:`factors`), but only its own
        modules' with ``factor_placement="by_module"`` (:attr:`factor_owners`)."""
        if self._by_module() is None:
            return self.factors
        owners, rank = self.factor_owners, self.ranks.rank
        return self._public_factors(
            [b for b in self._factor_slots() if owners is not None and owners[b.module] == rank]
        )

    @property
    def factor_owners(self) -> dict[str, int] | None:
        """``{module: rank}``, the rank holding each module's factors and eigendecompositions
        with ``factor_placement="by_module"`` (``None``: every rank holds every factor)."""
        owners = self._by_module()
        return None if owners is None else dict(owners.owners)  # type: ignore[attr-defined]

    #: the blocks holding the factors where they are not the operator's own blocks (EKFAC:
    #: KFAC's, whose eigenbases it keeps)
    _factor_blocks: list[Slot] | None = None
    #: why the factors are gone, where a subclass freed them (EKFAC's ``release_factors``)
    _factors_released: str | None = None

    def _factor_slots(self) -> list[Slot]:
        if self._factors_released is not None:
            raise ValueError(f"{type(self).__name__}: {self._factors_released}")
        return self._blocks if self._factor_blocks is None else self._factor_blocks

    def _by_module(self) -> ModuleBlocks | None:
        """The ranks' module blocks when each module's factors live on one rank, else ``None``."""
        blocks = self.ranks.module_blocks
        return blocks if blocks is not None and blocks.by_module else None

    def _refuse_by_module(self, what: str, instead: str) -> None:
        """One line refusing ``what`` where each module's factors live on one rank."""
        if self._by_module() is not None:
            raise ValueError(
                f"{type(self).__name__}.{what} with factor_placement='by_module': each module's "
                f"factors and eigenbases live on one rank (op.factor_owners); {instead}, or "
                "build the operator with factor_placement='replicated'"
            )

    def _public_factors(self, blocks: Sequence[Slot]) -> tuple[KroneckerBlock, ...]:
        if any(b.G is None for b in blocks):
            raise ValueError(
                f"{type(self).__name__} holds blocks given in their eigenbasis, not as factors; see eigh()"
            )
        return tuple(
            KroneckerBlock(b.names, b.module, b.G, self._A(b), b.transposed)  # type: ignore[arg-type]
            for b in blocks
        )

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if (sharded := self.ranks.module_blocks) is not None:
            return sharded.apply(V, lambda op, X: op._matmat_rows(X))
        out = self.layout.empty(V.shape[0])
        views, out_views = self.layout.split_rows(V), self.layout.split_rows(out)
        for block in self._blocks:
            X = gather(block, views, self.factor_dtype)
            if block.eigen is None:
                if block.G is None:
                    raise InternalError("block.G is not None")
                Y = block.G @ X @ self._A(block)
                if self.damping:
                    Y = Y.add_(X, alpha=self.damping)
            else:
                D, U_G, U_A = block.eigen
                Y = U_G @ ((U_G.T @ X @ U_A) * (D + self.damping if self.damping else D)) @ U_A.T
            scatter(block, Y, out_views)
        return out

    # -- the eigendecomposition and what it gives ----------------------------------------------
    def _versions(self) -> tuple[int, ...]:
        return self._decompositions.versions()

    def _eigen(self) -> list[Eigen]:
        """``(D (m, q), U_G, U_A)`` per block, undamped, eigenvalues at the rounding level zero
        (NOTE [eigenvalues at the rounding level]); cached, and recomputed for the factors
        changed in place since (NOTE [factors changed in place])."""
        if (sharded := self.ranks.module_blocks) is not None:
            return sharded.eigen()
        return self._decompositions.eigen()

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=self.factor_dtype, device=self.device)

    def eigh(self) -> KroneckerEigen:
        """Eigenvalues of the whole operator with the factors' eigenvectors, block by block
        (an eigenvalue at the rounding level of its factor's largest is ``0``, plus the damping:
        NOTE [eigenvalues at the rounding level]). Refused with ``factor_placement="by_module"``
        (every eigenbasis on every rank): :meth:`eigenvalues` and :meth:`eigenvector` work there."""
        self._refuse_by_module(
            "eigh()",
            "op.eigenvalues() gives every eigenvalue on every rank and op.eigenvector(block, i, j) "
            "one eigenvector",
        )
        return KroneckerEigen(
            tuple(
                KroneckerEigenBlock(
                    b.names, D + self.damping if self.damping else D, U_G, U_A, b.transposed
                )
                for b, (D, U_G, U_A) in zip(self._blocks, self._eigen(), strict=True)
            )
        )

    def eigenvalues(self, by_block: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Every eigenvalue of the operator (damping included), ascending ``(n,)``: the same as
        ``eigh().eigenvalues``; ``by_block=True``: each block's ``(m, q)`` instead, the eigenvalue
        of ``eigenvector(block, i, j)`` at ``[i, j]``. With ``factor_placement="by_module"`` the
        owners decompose their modules and every rank gets every eigenvalue (one collective)."""
        owners = self._by_module()
        undamped = owners.eigenvalues() if owners is not None else [D for D, _, _ in self._eigen()]
        values = [D + self.damping if self.damping else D for D in undamped]
        if by_block:
            return tuple(values)
        return torch.cat([D.reshape(-1) for D in values]).sort(stable=True).values

    def eigenvector(self, block: int, i: int, j: int) -> torch.Tensor:
        """The eigenvector ``u_G,i ⊗ u_A,j`` of block ``block`` in the flat layout ``(n,)``
        (unit norm; its eigenvalue is ``eigh().blocks[block].eigenvalues[i, j]``;
        ``eigh().locate(index)`` finds ``(block, i, j)`` of the ``index``-th eigenvalue)."""
        if not -len(self._blocks) <= block < len(self._blocks):
            raise IndexError(f"block {block} out of range for {len(self._blocks)} blocks")
        slot = self._blocks[block]
        if not (-slot.m <= i < slot.m and -slot.q <= j < slot.q):
            raise IndexError(
                f"(i, j) = ({i}, {j}) out of range for a block of ({slot.m}, {slot.q}) eigenvalues"
            )
        if (sharded := self.ranks.module_blocks) is not None:
            return sharded.eigenvector(block % len(self._blocks), i, j)
        _, U_G, U_A = self._eigen()[block]
        out = torch.zeros(1, self.size, dtype=self.dtype, device=self.device)
        scatter(slot, torch.outer(U_G[:, i], U_A[:, j]).unsqueeze(0), self.layout.split_rows(out))
        return out[0]

    def trace(self) -> torch.Tensor:
        """``tr`` of the operator, a 0-dim tensor in the factors' dtype: ``Σ tr(G)·tr(A)`` over
        factored blocks (no eigendecomposition), the eigenvalues' sum over the others."""
        if (owners := self._by_module()) is not None:
            return owners.total(lambda op: op.trace())
        terms = (
            b.G.trace() * self._A(b).trace() if b.G is not None else b.eigen[0].sum()  # type: ignore[index]
            for b in self._blocks
        )
        total = sum(terms, self._zero())
        return total + self.damping * self.size if self.damping else total

    def logdet(self, damping: float = 0.0) -> torch.Tensor:
        """``log det (K + damping·I)`` (e.g. a Laplace posterior's precision with an isotropic prior).

        Without damping a singular operator (cross-entropy's ``G`` always has the null vector of
        ones) gives ``-inf``: eigenvalues within rounding of zero count as zero (NOTE
        [eigenvalues at the rounding level]); an eigenvalue below zero beyond rounding (a factor
        that is not positive semi-definite) gives ``nan``."""
        shift = self.damping + check_damping(damping)
        if (owners := self._by_module()) is not None:
            return owners.total(lambda op: op.logdet(damping))
        return sum(((D + shift).log().sum() for D, _, _ in self._eigen()), self._zero())

    def frobenius_norm(self) -> torch.Tensor:
        """``‖·‖_F`` of the operator (from the factors where no damping and no eigenbasis)."""
        if (owners := self._by_module()) is not None:
            return owners.total(lambda op: op.frobenius_norm().square()).sqrt()
        if self.damping:
            squares = sum(
                ((D + self.damping).square().sum() for D, _, _ in self._eigen()),
                self._zero(),
            )
            return squares.sqrt()
        terms = (
            b.G.square().sum() * self._A(b).square().sum()
            if b.G is not None
            else b.eigen[0].square().sum()  # type: ignore[index]
            for b in self._blocks
        )
        return sum(terms, self._zero()).sqrt()

    def inverse(self, damping: float = 0.0) -> CurvatureOperator:
        """``(K + damping·I)⁻¹`` applied exactly through the eigendecompositions of each block.

        NOTE [exact damping]: K-FAC optimizers often damp each factor instead, ``(G + √λ I) ⊗
        (A + √λ I)``, which adds cross terms ``√λ (G ⊗ I + I ⊗ A)`` and is not ``K + λI``. Here
        every block is ``U (D + λ)⁻¹ Uᵀ`` with ``U = U_G ⊗ U_A``: the inverse of the damped
        operator itself (what a Laplace posterior or a linear solve needs), at the price of one
        eigendecomposition per factor (cached; recomputed after a factor changed in place).

        Singular blocks: an eigenvalue of an ``n × n`` factor within rounding of zero, ``|λ| <=
        n·eps·max|λ|``, is zero (NOTE [eigenvalues at the rounding level]), so ``(D + λ)⁻¹`` is
        ``1/λ`` there, never a huge finite number made of rounding noise. With no damping at all (``self.damping + damping == 0``) an operator with such an
        eigenvalue has no inverse (as ``torch.linalg.inv`` of a singular matrix): a
        ``ValueError`` naming the block, raised here (the decomposition is computed now, one
        synchronization) and at the first product after a factor changed in place. Pass
        ``damping > 0`` (cross-entropy's ``G`` is always singular).
        """
        shift = self.damping + check_damping(damping)
        inverse = _EigenFunction(self, lambda D: (D + shift).reciprocal())
        if shift == 0:
            inverse.refuse_singular = True
            inverse.check_invertible()
        return inverse

    def _eigen_apply(
        self, V: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if (sharded := self.ranks.module_blocks) is not None:
            return sharded.apply(V, lambda op, X: op._eigen_apply(X, fn))
        eigen = self._eigen()
        values = self._decompositions.applied(eigen, fn)
        out = self.layout.empty(V.shape[0])
        views, out_views = self.layout.split_rows(V), self.layout.split_rows(out)
        for block, (_, U_G, U_A), D in zip(self._blocks, eigen, values, strict=True):
            X = U_G.T @ gather(block, views, self.factor_dtype) @ U_A
            scatter(block, U_G @ (X * D) @ U_A.T, out_views)
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, blocks={len(self._blocks)}, "
            f"damping={self.damping}, dtype={self.dtype}, factor_dtype={self.factor_dtype})"
        )


class _EigenFunction(CurvatureOperator):
    """``f(K)`` of a Kronecker-factored operator ``K``, block by block in its eigenbasis."""

    def __init__(self, op: KroneckerOperator, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._op = op
        self._fn = fn
        self._size, self._device, self._dtype = op.size, op.device, op.dtype
        #: an undamped inverse: refuse a singular operator, again after a factor changed
        self.refuse_singular = False
        self._checked_at: tuple[int, ...] | None = None
        #: factors by module: each owned module's own undamped inverse, which checks its blocks
        self._module_inverses: dict[int, _EigenFunction] = {}

    def check_invertible(self) -> None:
        """Refuse a singular operator, once per version of its factors (Python integers read on
        each product; a synchronization only after a change)."""
        versions = self._op._versions()
        if versions != self._checked_at:
            self._refuse_singular()
            self._checked_at = versions

    def _refuse_singular(self) -> None:
        """A ``ValueError`` naming the first block with an eigenvalue at the rounding level of
        zero (NOTE [eigenvalues at the rounding level]); one synchronization."""
        op = self._op
        owners = op._by_module()  # by module: every block's eigenvalues, from their owners
        values = owners.eigenvalues() if owners is not None else [D for D, _, _ in op._eigen()]
        flags = torch.stack([(D == 0).any() for D in values])
        singular = flags.nonzero().flatten().tolist()
        if singular:
            b = op._blocks[singular[0]]
            where = f"layer {b.module!r} ({', '.join(b.names)})" if b.module else str(b.names)
            more = f" and {len(singular) - 1} more blocks" if len(singular) > 1 else ""
            raise ValueError(
                f"{type(op).__name__}.inverse() without damping: the block of {where}{more} "
                "is singular (an eigenvalue within rounding of zero: |λ| <= n·eps·max|λ| of an "
                "n × n factor), so the operator has no inverse; pass damping > 0, e.g. "
                "op.inverse(1e-3 * float(op.trace()) / op.size)"
            )

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if self.refuse_singular:
            if (owners := self._op._by_module()) is not None:
                # each owner checks its own modules (their versions are its alone); a refusal
                # there raises on every rank through the product's failure flags
                return owners.apply(V, lambda op, X: self._module_inverse(op)._matmat_rows(X))
            self.check_invertible()
        return self._op._eigen_apply(V, self._fn)

    def _module_inverse(self, op: KroneckerOperator) -> _EigenFunction:
        held = self._module_inverses.get(id(op))
        if held is None or held._op is not op:
            made = op.inverse()
            if not isinstance(made, _EigenFunction):
                raise InternalError("inverse() is an _EigenFunction")
            held = self._module_inverses[id(op)] = made
        return held
