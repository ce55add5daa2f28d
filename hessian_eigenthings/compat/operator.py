"""0.x ``Operator(size)`` with ``apply(vec)``, and 0.x ``LambdaOperator(apply_fn, size)``.

Both are 1.0 ``CurvatureOperator`` subclasses, so a user's 0.x operator works
with every 1.0 algorithm: ``matvec(v)`` calls ``apply(v)``. A 0.x operator
knows only its size, so its device and dtype are those of its first output
(float32 on the CPU before any product); until then it accepts vectors of
any floating dtype and device and returns products in the input's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hessian_eigenthings.compat._deprecations import warn_deprecated
from hessian_eigenthings.compat._translate import operator_size
from hessian_eigenthings.operators.base import CurvatureOperator


def _as_torch_dtype(value: Any) -> torch.dtype | None:
    """``value`` (a torch dtype, its name, or a numpy dtype) as a torch dtype; ``None`` if none."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    try:
        return torch.from_numpy(np.empty(0, dtype=value)).dtype
    except (TypeError, ValueError):
        return None


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

    # NOTE [0.x operator attributes]
    # A 0.x Operator was a plain object: subclasses assigned size, device, dtype, shape
    # or anything else, with or without calling Operator.__init__. The 1.0 base reads
    # size/device/dtype/shape through properties, so each gets a setter here: size keeps
    # 0.x's forms (an int or a shape), device and dtype become the operator's own (a
    # subclass that says where it lives is believed; a device or dtype name reads back as
    # the torch object it names).

    @property
    def size(self) -> int:
        return self._size  # an int: the setter converts

    @size.setter
    def size(self, value: Any) -> None:
        self._size = operator_size(value)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.size, self.size)

    @shape.setter
    def shape(self, value: Any) -> None:
        self._size = operator_size(value)

    @property
    def device(self) -> torch.device:
        return self._device

    @device.setter
    def device(self, value: Any) -> None:
        # not a device (e.g. None): the outputs tell, as for a bare 0.x operator
        with contextlib.suppress(TypeError, RuntimeError):
            self._device, self._learned = torch.device(value), True

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @dtype.setter
    def dtype(self, value: Any) -> None:
        dtype = _as_torch_dtype(value)
        if dtype is not None:  # otherwise the outputs tell
            self._dtype, self._learned = dtype, True

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
