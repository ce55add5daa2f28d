"""The eigendecompositions of a Kronecker-factored operator's blocks, cached while the factors
stay as they were.

:class:`FactorDecompositions` decomposes each distinct factor of the blocks once (a factor shared
by two blocks, a module's ``G`` for its weight and its bias, once), zeroes the eigenvalues at the
rounding level (NOTE [eigenvalues at the rounding level] in ``kronecker``), refuses factors that
hold NaN or inf naming their block, and follows changes in place through the factors' version
counters (NOTE [factors changed in place] in ``kronecker``). The operator's algebra on them is
:class:`~hessian_eigenthings.operators.kronecker.KroneckerOperator`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.operators.kronecker_blocks import Eigen, Slot

__all__ = [
    "NOT_FINITE_FIX",
    "FactorDecompositions",
    "at_rounding_level_zeroed",
    "not_finite_message",
    "refuse_not_finite",
]


def at_rounding_level_zeroed(lam: torch.Tensor, n: int, *, squares: bool = False) -> torch.Tensor:
    """``lam`` with the eigenvalues ``|λ| <= n·eps·max|lam|`` set to zero: the rank tolerance of
    ``torch.linalg.matrix_rank`` for an ``n × n`` matrix (NOTE [eigenvalues at the rounding
    level]); no host synchronization. ``squares``: eigenvalues of a block given in its eigenbasis
    (EKFAC's means of squared projections): zero at or below ``(n·eps)²·max|lam|``, and the
    negative ones down to ``-n·eps·max|lam|``."""
    if lam.numel() == 0:
        return lam
    rel = n * torch.finfo(lam.dtype).eps
    top = lam.abs().amax()
    if not squares:
        return torch.where(lam.abs() <= top * rel, torch.zeros_like(lam), lam)
    noise = (lam.abs() <= top * rel * rel) | ((lam < 0) & (lam >= -top * rel))
    return torch.where(noise, torch.zeros_like(lam), lam)


def canonical_null_basis(lam: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """``U`` with the columns of its zero eigenvalues ``lam == 0`` (at the rounding level:
    :func:`at_rounding_level_zeroed`) replaced by a basis of their span that depends on the span
    alone (NOTE [a canonical basis of the null space]); ``U`` itself when fewer than two."""
    zero = lam == 0
    z = int(zero.sum())  # one synchronization per decomposition (cached)
    if z < 2:
        return U
    idx = zero.nonzero().flatten()
    U0 = U[:, idx].to(torch.float64)
    weights = torch.arange(1, U.shape[0] + 1, dtype=torch.float64, device=U.device)
    _, R = torch.linalg.eigh(U0.T @ (weights.unsqueeze(1) * U0))
    V = U0 @ R
    top = V.abs().argmax(0)
    signs = V[top, torch.arange(z, device=U.device)].sign()
    V = V * torch.where(signs == 0, torch.ones_like(signs), signs)
    out = U.clone()
    out[:, idx] = V.to(U.dtype)
    return out


# NOTE [a canonical basis of the null space]: a factor made of fewer rows than its size (few
# samples, or a layer's inputs confined to a subspace) has a block of zero eigenvalues, whose
# eigenvectors ``eigh`` returns in an arbitrary basis of their span: another rounding of the
# same factor (summed in another order, on several ranks) gives another one. KFAC's products do
# not see it (the block acts as zero there), but EK-FAC's corrected eigenvalues are moments along
# each eigenvector, so there the operator would depend on that arbitrary choice (seen: scores
# 1.5-4% apart between one process and one replicated rank with fresh Monte-Carlo draws, NOTE
# [fresh draws]). The span is what rounding keeps (the gap to the smallest kept eigenvalue is
# far above it), so the basis is rebuilt from the span alone: the eigenvectors of ``diag(1, 2,
# ..., m)`` compressed onto it, each with its largest entry positive.


#: the fix that :func:`not_finite_message` ends with (a factor pass may name the culprit instead)
NOT_FINITE_FIX = "check the data and the parameters for NaN/inf"


def not_finite_message(
    who: str, factor: str, module: str, names: Sequence[str], more: int = 0
) -> str:
    """The one line that says a Kronecker factor holds NaN or inf, and where."""
    where = f"layer {module!r}" if module else f"the block over {tuple(names)}"
    others = (
        f", as {'is' if more == 1 else 'are'} {more} more factor{'s' * (more != 1)}" if more else ""
    )
    return (
        f"{who}: the Kronecker factor {factor} of {where} is not finite (NaN or inf){others}: "
        + NOT_FINITE_FIX
    )


def refuse_not_finite(who: str, factors: Sequence[tuple[str, str, torch.Tensor]]) -> None:
    """A ``ValueError`` naming the first of ``(factor, module, tensor)`` that holds NaN or inf
    (one synchronization for all of them: a factor pass checks its factors once)."""
    if not factors:
        return
    flags = torch.stack([t.isfinite().all() for _, _, t in factors])
    bad = (~flags).nonzero().flatten().tolist()
    if bad:
        factor, module, _ = factors[bad[0]]
        raise ValueError(not_finite_message(who, factor, module, (), len(bad) - 1))


# NOTE [factors decomposed in float64]: a float32 factor's eigenvectors from a float32 ``eigh``
# are accurate to about ``eps·‖G‖ / gap`` and orthogonal to about ``n·eps``: for the clustered
# small eigenvalues of a layer's input covariance that error is large, and a damped inverse
# (``1/λ`` in those directions) multiplies it. Measured on a two-layer GPT-2 of width 768
# (random weights, 16 sequences × 64 tokens, EK-FAC with empirical labels, damping 1e-3): float32
# influence scores 9.1% from float64 with float32 ``eigh``, 0.19% with float64 ``eigh`` of the
# same float32 factors (Kronfluence decomposes in float64 too: 0.12%). So a factor narrower
# than float64 is decomposed in float64 and its eigenvalues and eigenvectors are stored in the
# factor's dtype: the products keep the factor's dtype and memory; the decomposition costs
# float64 arithmetic once per factor (``n³``, cached).
#: ``id(factor) -> (factor, version, eigh(factor))``
_Decomposed = dict[int, tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]]]


class FactorDecompositions:
    """``(D (m, q), U_G, U_A)`` of each of ``blocks`` (module docstring), cached; ``who`` names
    the operator in errors."""

    def __init__(self, blocks: Sequence[Slot], who: str) -> None:
        self._blocks, self._who = blocks, who
        self._unit: torch.Tensor | None = None
        # NOTE [factors changed in place]: every distinct factor tensor (inference tensors keep
        # no version counter), whose versions the cached decompositions were made at
        seen: dict[int, torch.Tensor] = {}
        for b in blocks:
            for t in (b.G, b.A) if b.eigen is None else b.eigen:
                if t is not None and not t.is_inference():
                    seen.setdefault(id(t), t)
        self._tracked = tuple(seen.values())
        self._cache: list[Eigen] | None = None
        self._stamp: tuple[int, ...] = ()
        #: the last decomposition of each factor, with the factor's version then
        self._factor_eigh: _Decomposed = {}
        #: ``fn -> (decomposition, [fn(D) per block])`` of the eigenvalue functions applied
        self._applied: weakref.WeakKeyDictionary[
            Callable[[torch.Tensor], torch.Tensor], tuple[list[Eigen], list[torch.Tensor]]
        ] = weakref.WeakKeyDictionary()

    def A(self, block: Slot) -> torch.Tensor:
        """The block's input-side factor: ``[[1]]`` for a bias alone (made once, when first read:
        a factor pass's blocks add no kernel)."""
        if block.A is not None:
            return block.A
        if self._unit is None:
            G = block.G
            if G is None:
                raise InternalError("G is not None")
            self._unit = torch.ones(1, 1, dtype=G.dtype, device=G.device)
        return self._unit

    def versions(self) -> tuple[int, ...]:
        """The factors' version counters (Python integers: no device work)."""
        return tuple(t._version for t in self._tracked)

    def eigen(self) -> list[Eigen]:
        """``(D (m, q), U_G, U_A)`` per block, undamped, eigenvalues at the rounding level zero
        (a factor shared by several blocks is decomposed once); cached, and recomputed for the
        factors changed in place since."""
        stamp = self.versions()
        if self._cache is not None and stamp == self._stamp:
            return self._cache
        known = self._factor_eigh
        fresh: _Decomposed = {}
        made: list[tuple[str, Slot, torch.Tensor]] = []  # eigenvalues computed now

        def eig(M: torch.Tensor, which: str, block: Slot) -> tuple[torch.Tensor, torch.Tensor]:
            key = id(M)
            if key not in fresh:
                version = -1 if M.is_inference() else M._version
                held = known.get(key)
                if held is not None and held[0] is M and held[1] == version and version >= 0:
                    fresh[key] = held
                else:
                    lam, U = self._decompose(M, which, block)
                    made.append((which, block, lam))
                    zeroed = at_rounding_level_zeroed(lam, M.shape[0])
                    fresh[key] = (M, version, (zeroed, canonical_null_basis(zeroed, U)))
            return fresh[key][2]

        result = []
        for block in self._blocks:
            if block.eigen is not None:
                D, U_G, U_A = block.eigen
                made.append(("eigenvalues", block, D))
                result.append(
                    (at_rounding_level_zeroed(D, max(block.m, block.q), squares=True), U_G, U_A)
                )
                continue
            if block.G is None:
                raise AssertionError("unreachable: a block holds factors or an eigenbasis")
            lam_G, U_G = eig(block.G, "G", block)
            lam_A, U_A = eig(self.A(block), "A", block)
            result.append((lam_G.unsqueeze(1) * lam_A.unsqueeze(0), U_G, U_A))
        if made:  # NOTE [factors not finite]: one synchronization per decomposition
            flags = torch.stack([lam.isfinite().all() for _, _, lam in made])
            bad = (~flags).nonzero().flatten().tolist()
            if bad:
                which, block, _ = made[bad[0]]
                raise ValueError(not_finite_message(self._who, which, block.module, block.names))
        self._factor_eigh = fresh
        self._cache, self._stamp = result, stamp
        return result

    def _decompose(
        self, M: torch.Tensor, which: str, block: Slot
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.linalg.eigh(M)``, computed in float64 for a narrower factor and returned in
        the factor's dtype (NOTE [factors decomposed in float64]); a factor holding NaN or inf
        is refused naming its block (where the decomposition fails on it; where it returns NaN
        instead, :meth:`eigen` refuses the eigenvalues)."""
        try:
            if M.dtype == torch.float64 or not M.is_floating_point():
                return torch.linalg.eigh(M)
            lam, U = torch.linalg.eigh(M.to(torch.float64))
            return lam.to(M.dtype), U.to(M.dtype)
        except RuntimeError:  # torch.linalg.LinAlgError: "ill-conditioned or too many repeated"
            if bool(M.isfinite().all()):
                raise
            raise ValueError(
                not_finite_message(self._who, which, block.module, block.names)
            ) from None

    def applied(
        self, eigen: list[Eigen], fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[torch.Tensor]:
        """``fn(D)`` of each block of ``eigen``, once per decomposition, not per product."""
        held = self._applied.get(fn)
        if held is None or held[0] is not eigen:
            held = (eigen, [fn(D) for D, _, _ in eigen])
            self._applied[fn] = held
        return held[1]
