"""Adapters between our operators and curvlinops' linear operators (both ways).

- :func:`from_curvlinops` wraps a curvlinops ``PyTorchLinearOperator`` (its
  ``HessianLinearOperator``, ``GGNLinearOperator``, ``EFLinearOperator``,
  ``KFACLinearOperator``, sums and scalings of them, ...) as a
  :class:`~hessian_eigenthings.operators.base.CurvatureOperator`, so every
  algorithm of this library runs on it.
- :func:`to_curvlinops` wraps one of our operators as a curvlinops
  ``PyTorchLinearOperator``: it multiplies flat tensors ``(n,)`` / ``(n, k)``
  and, for operators built from a model, tensor lists in the parameters'
  shapes; ``.to_scipy()``, ``+``, ``*`` and curvlinops' trace, diagonal and
  spectrum estimators take it.

A scipy ``LinearOperator`` needs no adapter: ``op.to_scipy()``. laplace-torch backends
(its ``CurvatureInterface`` from our operators) live in :mod:`hessian_eigenthings.interop.laplace`,
a submodule that needs laplace-torch (``pip install hessian-eigenthings[laplace]``); this package
does not import it.

curvlinops (``pip install hessian-eigenthings[curvlinops]``) is imported
only when an adapter is called. Both adapters add no copy beyond the
reshapes between a flat block and curvlinops' tensor-list layout.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hessian_eigenthings.operators.base import CurvatureOperator

__all__ = ["CurvlinopsOperator", "from_curvlinops", "to_curvlinops"]


def _import_curvlinops_base() -> Any:
    try:
        # curvlinops imports linear_operator, whose import-time @torch.jit.script warns on
        # torch >= 2.10: third-party noise that is not the user's to act on
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*torch.jit.script.*", category=DeprecationWarning
            )
            warnings.filterwarnings(
                "ignore", message=".*torch.jit.script.*", category=FutureWarning
            )
            import curvlinops  # noqa: F401  (the package's __init__ is where the noise comes from)
            from curvlinops._torch_base import PyTorchLinearOperator
    except ImportError as exc:
        raise ImportError(
            "the curvlinops adapters need curvlinops; install it with "
            "`pip install hessian-eigenthings[curvlinops]` (package curvlinops-for-pytorch)"
        ) from exc
    return PyTorchLinearOperator


class CurvlinopsOperator(CurvatureOperator):
    """A curvlinops ``PyTorchLinearOperator`` seen as a :class:`CurvatureOperator`.

    Products go through the linop's ``@`` on flat tensors; a block ``(k, n)``
    of rows is one ``linop @ V`` with ``V (n, k)``, so curvlinops makes one
    pass over its data for the whole block.
    """

    def __init__(self, linop: Any) -> None:
        rows, cols = (int(s) for s in linop.shape)
        if rows != cols:
            raise ValueError(
                f"a curvature operator is square; the curvlinops operator has shape {linop.shape}"
            )
        if getattr(linop, "SELF_ADJOINT", True) is False:
            raise ValueError(
                f"{type(linop).__name__} is not self-adjoint (SELF_ADJOINT=False); the algorithms "
                "here assume a symmetric operator"
            )
        self.linop = linop
        self._size = rows
        self._device = torch.device(linop.device)
        self._dtype = linop.dtype

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linop @ v
        return out

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linop @ V.T
        return out.T


def from_curvlinops(linop: Any) -> CurvlinopsOperator:
    """Wrap a square, self-adjoint curvlinops ``PyTorchLinearOperator`` as a :class:`CurvatureOperator`.

    ``size``, ``device`` and ``dtype`` come from the linop. Parameters are
    flattened in the linop's own order (its ``params`` list), which for
    ``model.parameters()`` is the order of our operators with no
    ``param_filter``.
    """
    base = _import_curvlinops_base()
    if not isinstance(linop, base):
        raise TypeError(
            f"from_curvlinops expects a curvlinops PyTorchLinearOperator, got {type(linop).__name__}; "
            "for a plain function v -> A v use LambdaOperator"
        )
    return CurvlinopsOperator(linop)


_adapter_class: type | None = None


def _adapter() -> type:
    """The curvlinops subclass, built on first use so that curvlinops stays optional."""
    global _adapter_class
    if _adapter_class is not None:
        return _adapter_class
    base = _import_curvlinops_base()

    class CurvatureLinearOperatorAdapter(base):  # type: ignore[misc,valid-type]
        """One of our operators as a curvlinops ``PyTorchLinearOperator`` (self-adjoint)."""

        SELF_ADJOINT = True

        def __init__(self, op: CurvatureOperator) -> None:
            shapes = _operator_shapes(op)
            super().__init__(shapes, shapes)
            self.op = op
            self._numels = [s.numel() for s in self._in_shape]

        def _matmat(self, X: list[torch.Tensor]) -> list[torch.Tensor]:
            # curvlinops hands tensor lists (*shape_i, k); our operator wants one (n, k) block
            k = X[0].shape[-1]
            flat = X[0].reshape(-1, k) if len(X) == 1 else torch.cat([x.reshape(-1, k) for x in X])
            out = self.op.matmat(flat.to(self.op.dtype))
            return [
                part.reshape(*shape, k)
                for part, shape in zip(out.split(self._numels), self._in_shape, strict=True)
            ]

        @property
        def device(self) -> torch.device:
            return self.op.device

        @property
        def dtype(self) -> torch.dtype:
            return self.op.dtype

    CurvatureLinearOperatorAdapter.__qualname__ = "CurvatureLinearOperatorAdapter"
    _adapter_class = CurvatureLinearOperatorAdapter
    return _adapter_class


def _operator_shapes(op: CurvatureOperator) -> list[tuple[int, ...]]:
    layout = getattr(op, "layout", None)
    if layout is not None and hasattr(layout, "shapes"):
        return [tuple(s) for s in layout.shapes]
    return [(op.size,)]


def to_curvlinops(op: CurvatureOperator) -> Any:
    """Wrap ``op`` as a curvlinops ``PyTorchLinearOperator`` (self-adjoint).

    It multiplies a flat ``(n,)`` / ``(n, k)`` tensor, or, for an operator
    built from a model, a list of tensors in the selected parameters' shapes
    (with an optional trailing ``k``), as curvlinops' own operators do. A
    block goes through ``op.matmat`` in one call.
    """
    if not isinstance(op, CurvatureOperator):
        raise TypeError(f"to_curvlinops expects a CurvatureOperator, got {type(op).__name__}")
    return _adapter()(op)
