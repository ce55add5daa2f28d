"""0.x ``Operator(size)`` with ``apply(vec)``, and 0.x ``LambdaOperator(apply_fn, size)``.

Both are 1.0 ``CurvatureOperator`` subclasses, so a user's 0.x operator works
with every 1.0 algorithm: ``matvec(v)`` calls ``apply(v)``. A 0.x operator
knows only its size, so its device and dtype are those of its first output
(float32 on the CPU before any product); until then it accepts vectors of
any floating dtype and device and returns products in the input's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hessian_eigenthings.compat._deprecations import warn_deprecated
from hessian_eigenthings.operators.base import CurvatureOperator


class Operator(CurvatureOperator):
    """0.x abstract operator: subclasses implement ``apply(vec)``.

    Deprecated: subclass :class:`hessian_eigenthings.CurvatureOperator` and
    implement ``_matvec`` instead. Warns at construction.
    """

    _size = 0
    _dtype = torch.float32
    _device = torch.device("cpu")
    _learned = False  # device and dtype taken from an output yet?
    _plain = False  # did apply return a product shaped, typed and placed like its input?

    def __new__(cls, *args: Any, **kwargs: Any) -> Operator:
        # __new__ rather than __init__: 0.x subclasses often set self.size without calling super().__init__
        warn_deprecated("LambdaOperator" if issubclass(cls, LambdaOperator) else "Operator")
        return super().__new__(cls)

    def __init__(self, size: int) -> None:
        self.size = size

    @property
    def size(self) -> int:
        return self._size  # an int: the setter converts

    @size.setter
    def size(self, value: int) -> None:
        # 0.x stored size as a plain attribute that subclasses assign
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"size must be a positive int (the length of the flat vector), got {value!r}"
            )
        self._size = int(value)

    def apply(self, vec: torch.Tensor) -> torch.Tensor:
        """``A vec``; 0.x subclasses override this."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement apply(vec) (0.x) or _matvec(v) "
            "(1.0 CurvatureOperator)"
        )

    def _device_hint(self, device: torch.device) -> None:
        """Where a 0.x algorithm call puts its vectors (``use_gpu``), until an output tells."""
        if not self._learned:
            self._device = device

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        # a 0.x operator does not know its dtype or device up front: accept any tensor
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        out = self.apply(v)
        # Once apply has returned a product like its input (shape, dtype, device), later
        # inputs of that dtype take its output as it is: the checks cost ~1 us per product,
        # a few percent of a small operator's product.
        if self._plain and v.dtype is self._dtype:
            return out
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.apply must return a torch.Tensor, got {type(out).__name__}"
            )
        if not self._learned:
            self._device, self._dtype, self._learned = out.device, out.dtype, True
        if out.shape == v.shape and out.dtype == v.dtype and out.device == v.device:
            self._plain = out.dtype is self._dtype
            return out
        if out.shape != v.shape:
            out = out.reshape(v.shape)
        if out.dtype != v.dtype or out.device != v.device:
            out = out.to(device=v.device, dtype=v.dtype)
        return out


class LambdaOperator(Operator):
    """0.x ``LambdaOperator(apply_fn, size)``.

    Deprecated: use :class:`hessian_eigenthings.LambdaOperator` (``matvec_fn,
    size, device, dtype``). Warns at construction.
    """

    def __init__(self, apply_fn: Callable[[torch.Tensor], torch.Tensor], size: int) -> None:
        if not callable(apply_fn):
            raise TypeError(
                "apply_fn must be callable: vec -> A vec (1.0: LambdaOperator(matvec_fn, size, device, dtype))"
            )
        super().__init__(size)
        self.apply_fn = apply_fn

    def apply(self, vec: torch.Tensor) -> torch.Tensor:
        return self.apply_fn(vec)
