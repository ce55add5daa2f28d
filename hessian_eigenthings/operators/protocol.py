"""The operator protocol: a symmetric matrix-free operator over a flat vector.

:class:`CurvatureOperator` is known through products. Subclasses implement
``_matvec`` (one vector) or ``_matmat_rows`` (a row block ``(k, n)``); each
gets the other for free. The public ``matvec`` / ``matmat`` / ``@`` /
``__call__`` validate shape, dtype and device, then call the private one.
:class:`LambdaOperator` wraps a user's function. Operators defined by a model
and data build on this in ``operators.base``.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from typing import Any

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        current = (
            torch.cuda.current_device() if a.type == "cuda" and torch.cuda.is_available() else 0
        )
        return (a.index if a.index is not None else current) == (
            b.index if b.index is not None else current
        )
    return a.index == b.index


class CurvatureOperator(ABC):
    """Symmetric linear operator ``A`` of shape ``(n, n)``, known through products.

    Implement ``_matvec(v)`` for ``v`` of shape ``(n,)`` or
    ``_matmat_rows(V)`` for a row block ``(k, n)`` (k products at once); the
    other one is derived. ``num_matvecs`` counts products computed (a block
    of k counts k), which tests and benchmarks use as a noise-free cost.
    """

    num_matvecs: int = 0

    # -- to be provided by subclasses ------------------------------------
    @property
    def size(self) -> int:
        return int(self._size)

    @property
    def device(self) -> torch.device:
        return torch.device(self._device)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    _size: int
    _device: torch.device
    _dtype: torch.dtype

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        if type(self)._matmat_rows is CurvatureOperator._matmat_rows:
            raise NotImplementedError(
                f"{type(self).__name__} must implement _matvec or _matmat_rows"
            )
        return self._matmat_rows(v.unsqueeze(0))[0]

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if type(self)._matvec is CurvatureOperator._matvec:
            raise NotImplementedError(
                f"{type(self).__name__} must implement _matvec or _matmat_rows"
            )
        out = torch.empty_like(V)
        for i in range(V.shape[0]):
            out[i] = self._matvec(V[i])
        return out

    # -- public API -------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        return (self.size, self.size)

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(
                f"{what} has dtype {x.dtype} but the operator works in {self.dtype}; "
                f"pass x.to({self.dtype})"
            )
        if not same_device(x.device, self.device):
            raise ValueError(
                f"{what} is on {x.device} but the operator is on {self.device}; pass x.to('{self.device}')"
            )

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``A v`` for ``v`` of shape ``(n,)``."""
        self._check_input(v, "v")
        if v.dim() != 1 or v.shape[0] != self.size:
            raise ValueError(
                f"matvec expects a vector of shape ({self.size},), got {tuple(v.shape)}"
            )
        out = self._matvec(v)
        self.num_matvecs += 1
        return out

    def rmatvec(self, v: torch.Tensor) -> torch.Tensor:
        """``Aᵀ v`` (= ``A v``: curvature operators are symmetric)."""
        return self.matvec(v)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """``A V`` for ``V`` of shape ``(n, k)``: k products in one pass over the data.

        A block stored as rows ``B (k, n)`` costs no copy: ``op.matmat(B.T).T``.
        """
        self._check_input(V, "V")
        if V.dim() != 2 or V.shape[0] != self.size:
            raise ValueError(
                f"matmat expects a block of shape ({self.size}, k), got {tuple(V.shape)}"
            )
        if V.shape[1] == 0:
            return torch.empty_like(V)
        out = self._matmat_rows(V.T.contiguous())
        self.num_matvecs += V.shape[1]
        return out.T

    def inconsistency_causes(self) -> list[str]:
        """Why repeated products of this operator could disagree beyond rounding (for the
        algorithms' messages); empty when nothing specific is known."""
        causes = []
        if self.dtype in (torch.float16, torch.bfloat16):
            # a data operator of a half model computes in float32 unless precision="model" asked
            # for this (NOTE [half models] in operators.precision)
            causes.append(
                f"{str(self.dtype).removeprefix('torch.')} products carry about 1e-3 (float16) to 1e-2 (bfloat16) "
                "relative error (a data operator's products run in float32 unless precision='model')"
            )
        return causes

    def expect_products(self, n: int) -> None:  # noqa: B027 - optional hook, not abstract
        """Declare that about ``n`` products are coming (algorithms call this with their budget);
        operators that choose how to run their products use it. No-op by default."""

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return self.matmat(x)
        return self.matvec(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.__matmul__(x)

    def to_dense(self) -> torch.Tensor:
        """The full ``(n, n)`` matrix, by n products (for small n only)."""
        eye = torch.eye(self.size, dtype=self.dtype, device=self.device)
        return self.matmat(eye)

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` over float64 numpy vectors.

        Each scipy product converts to the operator's dtype and device and
        back (a host round trip per product): for ``eigsh``, ``cg``, ``lobpcg``.
        """
        import numpy as np
        from scipy.sparse.linalg import LinearOperator as ScipyLinearOperator

        def mv(x: Any) -> Any:
            v = torch.as_tensor(np.ascontiguousarray(x).reshape(-1), device=self.device).to(
                self.dtype
            )
            return self.matvec(v).detach().to("cpu", torch.float64).numpy()

        def mm(X: Any) -> Any:
            V = torch.as_tensor(np.ascontiguousarray(X), device=self.device).to(self.dtype)
            return self.matmat(V).detach().to("cpu", torch.float64).numpy()

        return ScipyLinearOperator(
            shape=self.shape, matvec=mv, rmatvec=mv, matmat=mm, dtype=np.float64
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, dtype={self.dtype}, device={self.device})"

    # -- algebra (A + B, A - B, c * A, A / c, -A, X @ A, submatrix): see operators/algebra.py
    def __add__(self, other: object) -> CurvatureOperator:
        return _algebra().linear_combination(self, other, 1.0)

    def __sub__(self, other: object) -> CurvatureOperator:
        return _algebra().linear_combination(self, other, -1.0)

    def __mul__(self, c: object) -> CurvatureOperator:
        return _algebra().scale(self, c)

    __rmul__ = __mul__

    def __truediv__(self, c: object) -> CurvatureOperator:
        return _algebra().scale(self, c, divide=True)

    def __neg__(self) -> CurvatureOperator:
        return _algebra().scale(self, -1.0)

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        return _algebra().left_multiply(self, x)

    def submatrix(self, rows: Any, cols: Any = None) -> Any:
        """``A[rows][:, cols]`` (slices, int sequences or tensors, bool masks): a symmetric operator
        when ``cols`` is omitted or equal to ``rows``, else a rectangular one (``operators.algebra``)."""
        return _algebra().submatrix(self, rows, cols)

    def block(self, param_filter: Any) -> Any:
        """``A[θ_S][:, θ_S]`` for the parameters ``S`` that ``param_filter`` (callable, glob or globs)
        selects among the operator's own: a ``SubmatrixOperator`` with their layout (``operators.algebra``)."""
        return _algebra().block(self, param_filter)


# NOTE [algebra binding]
# The algebra's operators (`A + B`, `c * A`, `A.submatrix(...)`, in operators/algebra.py) are
# CurvatureOperators, and the operator's own dunders build them. So that the two modules do not
# import each other, algebra imports this module and binds itself here when it is imported
# (`hessian_eigenthings.operators` imports it, and every import of this module goes through
# that package first).
_bound_algebra: Any = None


def bind_algebra(algebra: Any) -> None:
    """Called once by ``operators.algebra``: the module that builds the operators of ``A + B``, ...."""
    global _bound_algebra
    _bound_algebra = algebra


def _algebra() -> Any:
    return _bound_algebra


class LambdaOperator(CurvatureOperator):
    """An operator from a function ``v (n,) -> A v (n,)``.

    ``matmat_fn`` (optional) computes a row block ``(k, n) -> (k, n)`` at once;
    without it blocks are k calls of ``matvec_fn``.
    """

    def __init__(
        self,
        matvec_fn: Callable[[torch.Tensor], torch.Tensor],
        size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        matmat_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if not callable(matvec_fn):
            raise TypeError("matvec_fn must be callable: v (n,) -> A v (n,)")
        if int(size) < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._fn = matvec_fn
        self._block_fn = matmat_fn
        self._size = int(size)
        self._device = torch.device(device)
        self._dtype = dtype

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self._fn(v)

    def inconsistency_causes(self) -> list[str]:
        causes = super().inconsistency_causes()
        if self.device.type == "cuda" and self.dtype == torch.float32:
            tf32 = [
                n
                for n, on in (
                    ("matmul", torch.backends.cuda.matmul.allow_tf32),
                    ("cudnn", torch.backends.cudnn.allow_tf32),
                )
                if on
            ]
            if tf32:
                causes.append(
                    f"TF32 is on for {' and '.join(tf32)} (torch.backends.*.allow_tf32): float32 products of "
                    "your function carry about 1e-3 relative error"
                )
        return causes

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if self._block_fn is not None:
            return self._block_fn(V)
        return torch.stack([self._fn(V[i]) for i in range(V.shape[0])])
