"""Operator algebra: linear combinations, submatrices and left products of curvature operators.

Math. For symmetric ``A``, ``B`` of one size and real scalars ``c``:
``A + B``, ``A - B``, ``c * A``, ``A * c``, ``A / c`` and ``-A`` are the
symmetric operator ``Σ cᵢ Aᵢ`` (:class:`LinearCombinationOperator`).
``op.submatrix(rows, cols)`` is ``A[rows][:, cols]``: symmetric when the two
index sets are equal (:class:`SubmatrixOperator`, a ``CurvatureOperator``
that every algorithm accepts), rectangular otherwise
(:class:`RectangularSubmatrix`, products only: no eigensolver needs it).
``X @ A`` for a block ``X (m, n)`` is ``(A Xᵀ)ᵀ`` by symmetry.
``op.block(param_filter)`` is the submatrix on the coordinates of the parameters the filter
selects among the operator's own (``A[θ_S][:, θ_S]``), with their layout.

Cost. A product of ``Σ cᵢ Aᵢ`` with a vector or a block is one product of
each part with the same vector or block (a block stays one block: one data
pass per data-driven part), plus one scaled sum. A submatrix product is one
product of the parent with the input scattered into a zero vector of the
parent's size. Nothing is cached: the parts' own reuse (kept graphs, engines)
does the work, and each part counts its products in its own ``num_matvecs``.
"""

from __future__ import annotations

import itertools
import math
import numbers
import sys
from collections.abc import Sequence
from typing import Any

import torch

from hessian_eigenthings._checks import InternalError
from hessian_eigenthings.linalg import SingleDeviceBackend
from hessian_eigenthings.operators.protocol import CurvatureOperator, bind_algebra, same_device
from hessian_eigenthings.param_utils import ParamFilter, ParamLayout, as_param_filter

__all__ = [
    "LinearCombinationOperator",
    "RectangularSubmatrix",
    "SubmatrixOperator",
    "block",
    "left_multiply",
    "linear_combination",
    "scale",
    "submatrix",
]


def _scalar(c: object, what: str) -> float:
    """``c`` as a finite Python float: ints, floats, numpy scalars and 0-d tensors."""
    if isinstance(c, torch.Tensor):
        if c.numel() != 1 or c.dim() > 0:
            raise TypeError(
                f"{what} needs a scalar, got a tensor of shape {tuple(c.shape)}; "
                "to multiply an operator with vectors write A @ V (or V @ A)"
            )
        if c.is_complex():
            raise TypeError(f"{what} needs a real scalar, got a complex tensor")
        c = c.item()
    if isinstance(c, bool) or not isinstance(c, numbers.Real):
        raise TypeError(
            f"{what} needs a real scalar (int, float or 0-d tensor), got {type(c).__name__}"
        )
    value = float(c)
    if not math.isfinite(value):
        raise ValueError(f"{what} needs a finite scalar, got {value}")
    return value


def _is_single_device(backend: object) -> bool:
    return backend is None or isinstance(backend, SingleDeviceBackend)


def _check_compatible(ops: Sequence[CurvatureOperator]) -> None:
    first = ops[0]
    for other in ops[1:]:
        if other.size != first.size:
            raise ValueError(
                f"operators of different sizes cannot be combined: {type(first).__name__} has size "
                f"{first.size}, {type(other).__name__} has size {other.size} (select the same parameters)"
            )
        if other.dtype != first.dtype:
            raise TypeError(
                f"operators of different dtypes cannot be combined: {first.dtype} and {other.dtype}; "
                "build both from models of one dtype"
            )
        if not same_device(other.device, first.device):
            raise ValueError(
                f"operators on different devices cannot be combined: {first.device} and {other.device}"
            )
    # NOTE [combined backends]: a sharded operator (FSDP) holds a local shard of every vector and
    # reduces through its DistributedBackend; adding it to a replicated operator of equal local
    # size would add unrelated coordinates. Parts must agree: all single-device, or one backend.
    backends = [getattr(op, "backend", None) for op in ops]
    if not all(_is_single_device(b) for b in backends) and any(
        b is not backends[0] for b in backends
    ):
        raise ValueError(
            "a sharded operator (with a distributed backend) can only be combined with operators "
            "sharded the same way (the same op.backend)"
        )


class LinearCombinationOperator(CurvatureOperator):
    """``Σ cᵢ Aᵢ`` of symmetric operators of one size, dtype and device (what ``A + B``,
    ``A - B``, ``c * A``, ``A / c`` and ``-A`` return).

    ``terms`` is a tuple of ``(coefficient, operator)``. A product is one product of every
    part (a block as one block), so each part counts it in its own ``num_matvecs`` too.
    ``expect_products``, ``inconsistency_causes`` and ``backend`` are forwarded from the parts,
    and ``layout`` when every part has the same parameters.
    """

    def __init__(self, terms: Sequence[tuple[float, CurvatureOperator]]) -> None:
        if not terms:
            raise ValueError("a linear combination needs at least one operator")
        for _, op in terms:
            if not isinstance(op, CurvatureOperator):
                raise TypeError(
                    f"a linear combination needs CurvatureOperators, got {type(op).__name__}"
                )
        self.terms: tuple[tuple[float, CurvatureOperator], ...] = tuple(
            (_scalar(c, "a coefficient"), op) for c, op in terms
        )
        ops = [op for _, op in self.terms]
        _check_compatible(ops)
        self._size = ops[0].size
        self._dtype = ops[0].dtype
        self._device = ops[0].device
        self.backend = getattr(ops[0], "backend", None) or SingleDeviceBackend()
        if hasattr(ops[0], "global_size"):
            self.global_size = ops[0].global_size
        # parts over the same parameters share their layout (the curvlinops adapter reads it)
        layouts = [getattr(op, "layout", None) for op in ops]
        first = layouts[0]
        if first is not None and all(
            lay is not None and lay.names == first.names and lay.shapes == first.shapes
            for lay in layouts
        ):
            self.layout = first

    def _combine(self, products: list[torch.Tensor]) -> torch.Tensor:
        # a fresh output: a part may hand back a tensor it still uses (a user's LambdaOperator)
        out = products[0] * self.terms[0][0]
        for (c, _), p in zip(self.terms[1:], products[1:], strict=True):
            out.add_(p, alpha=c)
        return out

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self._combine([op.matvec(v) for _, op in self.terms])

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        # parts take columns: V.T is a free view, and matmat's result is a view of rows again
        return self._combine([op.matmat(V.T).T for _, op in self.terms])

    def expect_products(self, n: int) -> None:
        for _, op in self.terms:
            op.expect_products(n)

    def inconsistency_causes(self) -> list[str]:
        causes: list[str] = []
        for _, op in self.terms:
            for cause in op.inconsistency_causes():
                if cause not in causes:
                    causes.append(cause)
        return causes

    def __repr__(self) -> str:
        return " + ".join(f"{c:g}·{op!r}" for c, op in self.terms)


def linear_combination(a: CurvatureOperator, b: object, sign: float) -> LinearCombinationOperator:
    """``a + sign · b`` (``A + B`` and ``A - B``)."""
    if not isinstance(b, CurvatureOperator):
        symbol = "+" if sign > 0 else "-"
        raise TypeError(
            f"A {symbol} B needs two CurvatureOperators, got {type(b).__name__}; for a shift A + λI "
            "pass damping=λ to he.solve / he.inverse, or add LambdaOperator(lambda v: λ * v, A.size, "
            "A.device, A.dtype)"
        )
    return LinearCombinationOperator(((1.0, a), (sign, b)))


def scale(op: CurvatureOperator, c: object, *, divide: bool = False) -> LinearCombinationOperator:
    """``c · op`` (``c * A``, ``A * c``, ``-A``), or ``op / c`` with ``divide=True``."""
    value = _scalar(c, "A / c" if divide else "c * A")
    if divide:
        if value == 0.0:
            raise ZeroDivisionError("A / c with c = 0")
        value = 1.0 / value
    return LinearCombinationOperator(((value, op),))


def left_multiply(op: CurvatureOperator, x: object) -> torch.Tensor:
    """``X @ A`` for ``X (m, n)``, ``= (A Xᵀ)ᵀ`` by symmetry (one block product); ``v @ A`` for
    ``v (n,)`` is ``A v``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"X @ A needs a torch.Tensor X, got {type(x).__name__}")
    if x.dim() == 1:
        return op.matvec(x)
    if x.dim() != 2 or x.shape[1] != op.size:
        raise ValueError(
            f"X @ A needs X of shape (m, {op.size}) or ({op.size},), got {tuple(x.shape)}"
        )
    return op.matmat(x.T).T


# --------------------------------------------------------------------------
# Submatrices
# --------------------------------------------------------------------------


def _indices(index: object, n: int, device: torch.device, what: str) -> torch.Tensor:
    """An index selection (slice, int sequence, int tensor or bool mask of length ``n``) as a
    1-D int64 tensor on ``device``, every entry in ``[0, n)``."""
    if isinstance(index, slice):
        return torch.arange(n, device=device)[index]
    if isinstance(index, torch.Tensor):
        t = index
    elif isinstance(index, (Sequence, range)) and not isinstance(index, (str, bytes)):
        t = torch.as_tensor(list(index), dtype=torch.int64)
    else:
        raise TypeError(
            f"{what} must be a slice, a sequence of ints, an int tensor or a bool mask, got {type(index).__name__}"
        )
    if t.dtype == torch.bool:
        if t.shape != (n,):
            raise ValueError(f"{what} as a bool mask must have shape ({n},), got {tuple(t.shape)}")
        t = t.nonzero().squeeze(1)
    elif t.dtype.is_floating_point or t.is_complex():
        raise TypeError(f"{what} must hold integers or bools, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{what} selects nothing; select at least one index")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= n:
        raise ValueError(
            f"{what} must be in [0, {n}) for an operator of size {n}; got values from {lo} to {hi}"
        )
    return t.to(device=device, dtype=torch.int64)


def _scatter(parent: CurvatureOperator, R: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``R (k, len(idx))`` placed at columns ``idx`` of zero rows ``(k, n)``. ``index_add_`` so
    that a repeated index adds: the adjoint of selecting ``idx``."""
    out = torch.zeros(R.shape[0], parent.size, dtype=R.dtype, device=R.device)
    return out.index_add_(1, idx, R)


def _parent_rows(parent: CurvatureOperator, E: torch.Tensor) -> torch.Tensor:
    return parent.matvec(E[0]).unsqueeze(0) if E.shape[0] == 1 else parent.matmat(E.T).T


class SubmatrixOperator(CurvatureOperator):
    """``A[idx][:, idx]``: the symmetric block of ``parent`` on the indices ``idx``
    (``op.submatrix(rows)`` or ``op.submatrix(rows, rows)``); size ``len(idx)``.

    One product is one product of the parent on a zero vector with the input at ``idx``.
    """

    #: the parameters' layout when built by ``op.block(param_filter)`` (else not set)
    layout: ParamLayout
    named_params: list[tuple[str, torch.nn.Parameter]]

    def __init__(self, parent: CurvatureOperator, idx: torch.Tensor) -> None:
        self.parent = parent
        self.idx = idx
        self._size = int(idx.numel())
        self._dtype = parent.dtype
        self._device = parent.device

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        return _parent_rows(self.parent, _scatter(self.parent, V, self.idx))[:, self.idx]

    def expect_products(self, n: int) -> None:
        self.parent.expect_products(n)

    def inconsistency_causes(self) -> list[str]:
        return self.parent.inconsistency_causes()

    def __repr__(self) -> str:
        return f"SubmatrixOperator(size={self.size}, parent={self.parent!r})"


class RectangularSubmatrix:
    """``A[rows][:, cols]`` for different row and column sets: a linear operator of shape
    ``(len(rows), len(cols))`` with ``matvec``, ``rmatvec``, ``matmat``, ``@``, ``.T``,
    ``to_dense`` and ``to_scipy``. It is not a ``CurvatureOperator`` (not square, not
    symmetric), so eigensolvers refuse it. ``rmatvec`` uses the parent's symmetry:
    ``A[rows][:, cols]ᵀ = A[cols][:, rows]``.
    """

    def __init__(self, parent: CurvatureOperator, rows: torch.Tensor, cols: torch.Tensor) -> None:
        self.parent = parent
        self.rows = rows
        self.cols = cols
        self.num_matvecs = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.rows.numel()), int(self.cols.numel()))

    @property
    def dtype(self) -> torch.dtype:
        return self.parent.dtype

    @property
    def device(self) -> torch.device:
        return self.parent.device

    @property
    def T(self) -> RectangularSubmatrix:
        """The transpose ``A[cols][:, rows]``."""
        return RectangularSubmatrix(self.parent, self.cols, self.rows)

    def _apply(
        self,
        X: object,
        src: torch.Tensor,
        dst: torch.Tensor,
        name: str,
        dims: tuple[int, ...] = (1, 2),
    ) -> torch.Tensor:
        if not isinstance(X, torch.Tensor):
            raise TypeError(f"{name} needs a torch.Tensor, got {type(X).__name__}")
        p = int(src.numel())
        if X.dim() not in dims or X.shape[0] != p:
            want = " or ".join(f"({p},)" if d == 1 else f"({p}, k)" for d in dims)
            raise ValueError(f"{name} needs shape {want}, got {tuple(X.shape)}")
        vector = X.dim() == 1
        rows = X.unsqueeze(0) if vector else X.T
        if rows.shape[0] == 0:
            return X.new_empty(int(dst.numel()), 0)
        out = _parent_rows(self.parent, _scatter(self.parent, rows, src))[:, dst]
        self.num_matvecs += rows.shape[0]
        return out[0] if vector else out.T

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A[rows][:, cols] v`` for ``v (len(cols),)``."""
        return self._apply(v, self.cols, self.rows, "matvec", (1,))

    def rmatvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A[rows][:, cols]ᵀ v`` for ``v (len(rows),)``."""
        return self._apply(v, self.rows, self.cols, "rmatvec", (1,))

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``A[rows][:, cols] V`` for ``V (len(cols), k)``: one block product of the parent."""
        return self._apply(V, self.cols, self.rows, "matmat", (2,))

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply(x, self.cols, self.rows, "S @ x")

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        # X S = (Sᵀ Xᵀ)ᵀ
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return self._apply(x.T, self.rows, self.cols, "X @ S").T
        return self._apply(x, self.rows, self.cols, "x @ S")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.__matmul__(x)

    def to_dense(self) -> torch.Tensor:
        """The ``(len(rows), len(cols))`` matrix, by ``len(cols)`` products (small sizes only)."""
        return self.matmat(torch.eye(self.shape[1], dtype=self.dtype, device=self.device))

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` over float64 numpy arrays (``matvec``,
        ``rmatvec``, ``matmat``; a host round trip per product), for ``lsqr`` / ``svds``."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator as ScipyLinearOperator

        def wrap(fn: Any, flat: bool) -> Any:
            def call(x: Any) -> Any:
                arr = np.ascontiguousarray(x)
                t = torch.as_tensor(arr.reshape(-1) if flat else arr, device=self.device).to(
                    self.dtype
                )
                return fn(t).detach().to("cpu", torch.float64).numpy()

            return call

        return ScipyLinearOperator(
            shape=self.shape,
            matvec=wrap(self.matvec, True),
            rmatvec=wrap(self.rmatvec, True),
            matmat=wrap(self.matmat, False),
            dtype=np.float64,
        )

    def __repr__(self) -> str:
        return f"RectangularSubmatrix(shape={self.shape}, parent={self.parent!r})"


def submatrix(
    op: CurvatureOperator, rows: object, cols: object = None
) -> SubmatrixOperator | RectangularSubmatrix:
    """``A[rows][:, cols]``; a :class:`SubmatrixOperator` when ``cols`` is ``None`` or selects the
    same indices in the same order as ``rows``, else a :class:`RectangularSubmatrix`."""
    if not _is_single_device(getattr(op, "backend", None)):
        raise ValueError(
            "submatrix of a sharded operator (distributed backend) is not supported: its vectors are "
            "local shards, so indices would mean different coordinates on every rank"
        )
    r = _indices(rows, op.size, op.device, "rows")
    if cols is None:
        return SubmatrixOperator(op, r)
    c = _indices(cols, op.size, op.device, "cols")
    if r.shape == c.shape and bool(torch.equal(r, c)):
        return SubmatrixOperator(op, r)
    return RectangularSubmatrix(op, r, c)


def block(
    op: CurvatureOperator, param_filter: ParamFilter | str | Sequence[str]
) -> SubmatrixOperator:
    """``A[θ_S][:, θ_S]`` for the parameters ``S`` that ``param_filter`` (a callable
    ``(name, param) -> bool``, a glob or a list of globs, as for the operators) selects among
    ``op``'s own parameters (``op.layout``), in ``op``'s order. The result is a
    :class:`SubmatrixOperator` with the layout of ``S`` (so the curvlinops adapter and a further
    ``.block`` work on it). A product is one product of ``op``.
    """
    layout = getattr(op, "layout", None)
    if not isinstance(layout, ParamLayout):
        raise TypeError(
            f"block(param_filter) needs an operator over named parameters (with a .layout), got "
            f"{type(op).__name__}; use op.submatrix(indices) for index sets"
        )
    flt = as_param_filter(param_filter)
    if flt is None:
        raise TypeError(
            "param_filter must be a callable (name, param) -> bool, a glob string or a list of globs, got None"
        )
    tensors: dict[str, torch.nn.Parameter] = dict(getattr(op, "named_params", None) or [])
    chosen = []
    for i, (name, shape) in enumerate(zip(layout.names, layout.shapes, strict=True)):
        param = tensors.get(name)
        if (
            param is None
        ):  # a combination's layout without its tensors: the shape is what a filter sees
            param = torch.nn.Parameter(
                torch.empty(shape, dtype=layout.dtype, device="meta"), requires_grad=False
            )
        if flt(name, param):
            chosen.append(i)
    if not chosen:
        shown = ", ".join(layout.names[:8]) + (
            f", ... ({len(layout.names)} in all)" if len(layout.names) > 8 else ""
        )
        raise ValueError(
            f"param_filter {getattr(flt, '__qualname__', flt)!r} selected none of the operator's parameters: {shown}"
        )
    offsets = layout.offsets
    idx = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in chosen])
    sub = submatrix(op, idx)
    if not (isinstance(sub, SubmatrixOperator)):
        raise InternalError("isinstance(sub, SubmatrixOperator)")
    sub.layout = ParamLayout(
        names=tuple(layout.names[i] for i in chosen),
        shapes=tuple(layout.shapes[i] for i in chosen),
        offsets=tuple([0, *itertools.accumulate(math.prod(layout.shapes[i]) for i in chosen)]),
        dtype=layout.dtype,
        device=layout.device,
    )
    sub.named_params = [(n, tensors[n]) for n in sub.layout.names if n in tensors]
    return sub


bind_algebra(sys.modules[__name__])  # NOTE [algebra binding]
