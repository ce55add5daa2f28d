"""The blocks of a Kronecker-factored operator as a user gives them, and how they are read.

:class:`KroneckerBlock` (``G ⊗ A`` over one parameter, or a weight and its bias) and
:class:`KroneckerEigenBlock` (a block in its eigenbasis) are read into ``Slot``: where the block
sits in the flat vector, with the reading rules of the ``kronecker`` module's docstring (a
weight's rows, a conv weight flattened, a ``Conv1D`` weight transposed, a bias as a last column or
alone), checked (:func:`_checked`: shapes, every parameter in one block, one floating dtype, the
layout's device). A factor pass's blocks are read without checks (:func:`factor_slot`). A block's
parameters in a row block of vectors become its matrices and back with :func:`gather` and
:func:`scatter`. The algebra on them is :class:`~hessian_eigenthings.operators.kronecker.
KroneckerOperator`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.operators.protocol import same_device
from hessian_eigenthings.param_utils import ParamLayout

__all__ = [
    "Block",
    "Eigen",
    "KroneckerBlock",
    "KroneckerEigenBlock",
    "Slot",
    "checked_blocks",
    "factor_slot",
    "gather",
    "scatter",
]


@dataclass(frozen=True)
class KroneckerBlock:
    """One diagonal block ``G ⊗ A`` of the operator over the parameters ``names``.

    The block acts on the matrix ``X (m, q)`` made of the parameters' entries:
    the weight's rows (a conv weight flattened to ``(out, in·kh·kw)``; a ``Conv1D`` weight
    ``(in, out)`` transposed), then the bias as a last column when it is joined to the weight; a bias alone is
    ``(m, 1)`` with ``A = [[1]]``. ``G`` is ``(m, m)``, ``A`` is ``(q, q)``, both symmetric.
    """

    names: tuple[str, ...]
    module: str  # the module's name in the model (a label; may be "")
    G: torch.Tensor  # (m, m) output-side factor
    A: torch.Tensor  # (q, q) input-side factor
    transposed: bool = False  # the first parameter is stored (in, out) and read as its transpose


@dataclass(frozen=True)
class KroneckerEigenBlock:
    """One diagonal block in its eigenbasis: eigenvalue ``eigenvalues[i, j]`` belongs to the
    eigenvector ``u_G,i ⊗ u_A,j``, laid out in ``names`` as :class:`KroneckerBlock` reads them."""

    names: tuple[str, ...]
    eigenvalues: torch.Tensor  # (m, q): eigenvalue of u_G[:, i] ⊗ u_A[:, j] at [i, j]
    G_eigenvectors: torch.Tensor  # (m, m), columns
    A_eigenvectors: torch.Tensor  # (q, q), columns
    transposed: bool = False


Block = KroneckerBlock | KroneckerEigenBlock
Eigen = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (D (m, q), U_G (m, m), U_A (q, q))


@dataclass(eq=False)
class Slot:
    """Where a block sits in the flat vector and what it holds (factors or an eigenbasis)."""

    names: tuple[str, ...]
    module: str
    weight: int | None  # layout index of the parameter read as the matrix's first columns
    bias: int | None  # layout index of the parameter read as its last column (or alone)
    transposed: bool
    m: int
    d: int  # columns of the weight part (0 for a bias alone)
    G: torch.Tensor | None = None  # None: given in its eigenbasis
    A: torch.Tensor | None = None  # None with G set: a bias alone, A = [[1]]
    eigen: Eigen | None = None  # given eigenbasis and eigenvalues

    @property
    def q(self) -> int:
        return self.d + int(self.bias is not None)


def _slot(
    layout: ParamLayout, weight: int | None, bias: int | None, module: str, transposed: bool
) -> Slot:
    """The block over parameters ``weight`` (read as a matrix) and ``bias`` (a last column, or
    alone), by their indices in ``layout``, with the reading rules of ``kronecker``'s docstring."""
    names = tuple(layout.names[i] for i in (weight, bias) if i is not None)
    if weight is None:
        if bias is None:
            raise InternalError("bias is not None")
        shape = layout.shapes[bias]
        if len(shape) != 1 or transposed:
            raise ValueError(
                f"a parameter alone in a block as a column (m, 1) is one-dimensional; "
                f"{names[0]!r} has shape {tuple(shape)}{' (transposed=True)' if transposed else ''}"
            )
        return Slot(names, module, None, bias, False, shape.numel(), 0)
    w = layout.shapes[weight]
    if len(w) < 2 or (transposed and len(w) != 2):
        raise ValueError(
            f"the first parameter of a block is read as a matrix; {names[0]!r} has shape {tuple(w)}"
        )
    m, d = (w[1], w[0]) if transposed else (w[0], w[1:].numel())
    if bias is not None and tuple(layout.shapes[bias]) != (m,):
        raise ValueError(
            f"the second parameter of a block is a bias of shape ({m},) for {names[0]!r}; "
            f"{names[1]!r} has shape {tuple(layout.shapes[bias])}"
        )
    return Slot(names, module, weight, bias, transposed, m, d)


def _place(
    layout: ParamLayout,
    index: Mapping[str, int],
    names: str | Sequence[str],
    module: str,
    transposed: bool,
) -> Slot:
    """The block over ``names`` (one parameter, or a weight and its bias) in ``layout``."""
    names = (names,) if isinstance(names, str) else tuple(names)
    missing = [n for n in names if n not in index]
    if missing or not 1 <= len(names) <= 2:
        shown = ", ".join(layout.names[:6]) + (", ..." if len(layout.names) > 6 else "")
        raise ValueError(
            f"a Kronecker block covers one parameter, or a weight and its bias, of the layout "
            f"({shown}); got names={names}" + (f", unknown: {missing}" if missing else "")
        )
    if len(names) == 1 and len(layout.shapes[index[names[0]]]) == 1 and not transposed:
        return _slot(layout, None, index[names[0]], module, transposed)
    bias = index[names[1]] if len(names) == 2 else None
    return _slot(layout, index[names[0]], bias, module, transposed)


def _check_square(name: str, M: torch.Tensor, size: int, owner: tuple[str, ...]) -> None:
    if not isinstance(M, torch.Tensor) or tuple(M.shape) != (size, size):
        got = tuple(M.shape) if isinstance(M, torch.Tensor) else type(M).__name__
        raise ValueError(f"{name} of the block over {owner} must be ({size}, {size}), got {got}")


_BLOCK_TYPES = "blocks holds KroneckerBlock(names, module, G, A) or KroneckerEigenBlock entries"


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of an inference tensor (it keeps no version counter to follow: NOTE
    [factors changed in place])."""
    if isinstance(t, torch.Tensor) and t.is_inference():
        with torch.inference_mode(False):
            return t.clone()
    return t


def _normalize(layout: ParamLayout, index: Mapping[str, int], block: object) -> Slot:
    if isinstance(block, KroneckerBlock):
        slot = _place(layout, index, block.names, block.module, block.transposed)
        _check_square("G", block.G, slot.m, slot.names)
        _check_square("A", block.A, slot.q, slot.names)
        slot.G, slot.A = _own(block.G), _own(block.A)
        return slot
    if isinstance(block, KroneckerEigenBlock):
        slot = _place(layout, index, block.names, "", block.transposed)
        _check_square("G_eigenvectors", block.G_eigenvectors, slot.m, slot.names)
        _check_square("A_eigenvectors", block.A_eigenvectors, slot.q, slot.names)
        if tuple(block.eigenvalues.shape) != (slot.m, slot.q):
            raise ValueError(
                f"eigenvalues of the block over {slot.names} must be ({slot.m}, {slot.q}), "
                f"got {tuple(block.eigenvalues.shape)}"
            )
        slot.eigen = (
            _own(block.eigenvalues),
            _own(block.G_eigenvectors),
            _own(block.A_eigenvectors),
        )
        return slot
    raise TypeError(_BLOCK_TYPES + f", got {type(block).__name__}")


def _as_layout(layout: object, first: torch.Tensor) -> ParamLayout:
    """A :class:`ParamLayout`; named shapes take the factors' dtype and device."""
    if isinstance(layout, ParamLayout):
        return layout
    pairs = list(layout.items()) if isinstance(layout, Mapping) else list(layout)  # type: ignore[call-overload]
    if pairs and all(isinstance(t, torch.Tensor) for _, t in pairs):
        return ParamLayout.from_named(pairs)
    if not pairs:
        raise ValueError("a Kronecker operator needs at least one parameter in its layout")
    shapes = [torch.Size(s) for _, s in pairs]
    offsets = [0]
    for s in shapes:
        offsets.append(offsets[-1] + s.numel())
    return ParamLayout(
        tuple(str(n) for n, _ in pairs), tuple(shapes), tuple(offsets), first.dtype, first.device
    )


def checked_blocks(layout: object, given: Sequence[object]) -> tuple[ParamLayout, list[Slot]]:
    """The layout and the blocks of a user's ``KroneckerOperator(layout, blocks)``, checked:
    shapes, every parameter in one block, one floating dtype, the layout's device."""
    blocks = list(given)
    if not blocks:
        raise ValueError("a Kronecker operator needs at least one block")
    first = blocks[0]
    if not isinstance(first, (KroneckerBlock, KroneckerEigenBlock)):
        raise TypeError(_BLOCK_TYPES + f", got {type(first).__name__}")
    factor = first.G if isinstance(first, KroneckerBlock) else first.eigenvalues
    if not isinstance(factor, torch.Tensor):
        raise TypeError(f"a block's factors are tensors, got {type(factor).__name__}")
    lay = _as_layout(layout, factor)
    index = {name: i for i, name in enumerate(lay.names)}
    slots = [_normalize(lay, index, b) for b in blocks]
    covered = Counter(i for s in slots for i in (s.weight, s.bias) if i is not None)
    twice = sorted(lay.names[i] for i, count in covered.items() if count > 1)
    missing = [n for i, n in enumerate(lay.names) if i not in covered]
    if twice or missing:
        raise ValueError(
            "every parameter of the layout belongs to exactly one block; "
            + (f"in several: {twice}" if twice else f"in none: {missing}")
        )
    tensors = [t for s in slots for t in ((s.G, s.A) if s.eigen is None else s.eigen)]
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TypeError(
            f"the factors must share one floating dtype, got {sorted(map(str, dtypes))}"
        )
    off = [
        str(t.device) for t in tensors if t is not None and not same_device(t.device, lay.device)
    ]
    if off:
        raise ValueError(f"the factors must be on the layout's device {lay.device}, found {off[0]}")
    return lay, slots


def factor_slot(
    layout: ParamLayout,
    weight: int | None,
    bias: int | None,
    module: str,
    G: torch.Tensor | None,
    A: torch.Tensor | None,
    transposed: bool = False,
    eigen: Eigen | None = None,
) -> Slot:
    """A factor pass's block, trusted (no checks, little host time: it runs once per block of a
    pass): the block over the parameters ``weight`` and ``bias`` (layout indices) as ``G ⊗ A``
    (``A=None``: a bias alone, ``[[1]]``) or in the eigenbasis ``eigen``."""
    names = layout.names
    if weight is None:
        if bias is None:
            raise InternalError("bias is not None")
        m = layout.shapes[bias][0]
        return Slot((names[bias],), module, None, bias, False, m, 0, G, A, eigen)
    w = layout.shapes[weight]
    m, d = (w[1], w[0]) if transposed else (w[0], math.prod(w[1:]))
    held = (names[weight],) if bias is None else (names[weight], names[bias])
    return Slot(held, module, weight, bias, transposed, m, d, G, A, eigen)


def gather(block: Slot, views: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``(k, m, q)`` of the block's parameters in a row block's per-parameter views, in ``dtype``."""
    parts = []
    if block.weight is not None:
        w = views[block.weight]
        if block.transposed:  # (k, in, out) entries: X is the transpose
            parts.append(w.transpose(1, 2))
        else:
            parts.append(w.reshape(w.shape[0], w.shape[1], -1))
    if block.bias is not None:
        parts.append(views[block.bias].unsqueeze(-1))
    X = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return X.to(dtype)


def scatter(block: Slot, Y: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Writes ``Y (k, m, q)`` into the block's parameters in a row block's views (the inverse
    of :func:`gather`)."""
    if block.weight is None:
        if block.bias is None:
            raise InternalError("block.bias is not None")
        views[block.bias].copy_(Y[..., 0])
        return
    w, d = views[block.weight], block.d
    if block.transposed:
        w.copy_(Y[..., :d].transpose(-1, -2))
    else:
        w.copy_(Y[..., :d].reshape(w.shape))
    if block.bias is not None:
        views[block.bias].copy_(Y[..., d])
