"""Argument and result translation shared by the 0.x entry points.

Nothing here computes: it validates 0.x arguments (raising the error kind a
0.x user would expect, in words that also name the 1.0 way), picks devices
and dtypes, wraps objects so the core accepts them, and converts results to
the types 0.x returned.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import warnings
from operator import index
from typing import Any

import numpy as np
import torch

from hessian_eigenthings.algorithms.result import ConvergenceWarning, quiet_convergence_warnings
from hessian_eigenthings.compat._deprecations import user_stacklevel, warn_cpu_fallback
from hessian_eigenthings.operators.base import CurvatureOperator

# NOTE [0.x argument values]
# 0.x validated nothing: flags were read with `if flag:`, counts went to `range()`,
# thresholds to `<` comparisons. So any truthy or falsy object is a flag (a positional
# 128 landing in fp16 means fp16), any integer-like (`operator.index`, bools included,
# as range() takes them) is a count, and any real number a threshold (negative
# thresholds never stop early: 0.x users pass them to force a fixed number of steps).
# Only what 0.x itself crashed on raises here, and the message says what 0.x did.


def operator_size(value: Any) -> int:
    """A 0.x ``Operator.size``: an int, or a shape ``(n,)`` / ``(n, n)`` (0.x's lanczos took both)."""
    if isinstance(value, (tuple, list, torch.Size)) and len(value) in (1, 2):
        value = value[0]
    try:
        n = index(value)
    except TypeError:
        raise TypeError(
            f"size must be an int (the length of the flat vector), got {value!r}"
        ) from None
    if n < 1:
        raise ValueError(f"size must be a positive int (the length of the flat vector), got {n}")
    return n


def flag(value: Any) -> bool:
    """A 0.x flag: truthiness, as 0.x's ``if flag:``."""
    return bool(value)


def count(name: str, value: Any, *, hint: str) -> int:
    """A 0.x count (anything ``range()`` takes); ``hint`` names the 1.0 argument it becomes."""
    try:
        return index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} (0.x passed it to range(), which "
            f"raised TypeError too; {hint})"
        ) from None


def real(name: str, value: Any, *, hint: str) -> float:
    """A 0.x threshold or coefficient: any real number (0.x compared or multiplied it)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({hint})")
    return float(value)


def requested_device(use_gpu: Any, what: str) -> torch.device:
    """Where 0.x would have put its vectors: CUDA when ``use_gpu`` and available.

    ``use_gpu=True`` without CUDA warns (once per call site) and gives the CPU.
    """
    if flag(use_gpu):
        if torch.cuda.is_available():
            return torch.device("cuda")
        warn_cpu_fallback(what)
    return torch.device("cpu")


class _ApplyAdapter(CurvatureOperator):
    """A 0.x duck-typed operator (``.size`` and ``.apply(vec)``, no base class) seen as a 1.0 one.

    Device and dtype as for a bare 0.x ``Operator``: the hint until the
    first product, then those of the first output.
    """

    def __init__(self, obj: Any, device: torch.device) -> None:
        self.obj = obj
        self._size = operator_size(obj.size)
        self._device = device
        self._dtype = torch.float32

    def _check_input(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        out = self.obj.apply(v)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{type(self.obj).__name__}.apply must return a torch.Tensor, got {type(out).__name__}"
            )
        self._device, self._dtype = out.device, out.dtype
        if out.shape != v.shape:
            out = out.reshape(v.shape)
        if out.dtype != v.dtype or out.device != v.device:
            out = out.to(device=v.device, dtype=v.dtype)
        return out


class _CastOperator(CurvatureOperator):
    """``inner`` seen in another dtype: inputs cast to ``inner.dtype``, outputs cast back.

    This is how ``fp16=True`` keeps the algorithms' vectors in half precision
    (as 0.x did) while the model computes in its own dtype.
    """

    def __init__(self, inner: CurvatureOperator, dtype: torch.dtype) -> None:
        self.inner = inner
        self._dtype = dtype

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        out = self.inner.matmat(V.T.to(self.inner.dtype)).T
        return out.to(self._dtype)

    def _matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self.inner.matvec(v.to(self.inner.dtype)).to(self._dtype)

    def expect_products(self, n: int) -> None:
        self.inner.expect_products(n)


def as_core_operator(operator: Any, *, use_gpu: Any, fp16: Any, what: str) -> CurvatureOperator:
    """The 1.0 operator an 0.x algorithm runs on.

    1.0 operators (``HVPOperator`` and 0.x ``Operator`` subclasses are 1.0
    operators too) pass through; any other object with ``size`` and
    ``apply(vec)`` is adapted. ``fp16=True`` views the operator in float16.
    """
    device = requested_device(use_gpu, what)
    half = flag(fp16)
    op: CurvatureOperator
    if isinstance(operator, CurvatureOperator):
        op = operator
        hint = getattr(op, "_device_hint", None)
        if hint is not None:
            hint(device)
    elif hasattr(operator, "apply") and hasattr(operator, "size"):
        op = _ApplyAdapter(operator, device)
    else:
        raise TypeError(
            f"{what}: operator must have .size and .apply(vec) (0.x) or be a "
            f"hessian_eigenthings.CurvatureOperator (1.0); got {type(operator).__name__}"
        )
    if half and op.dtype != torch.float16:
        op = _CastOperator(op, torch.float16)
    return op


def init_vector(vec: Any, op: CurvatureOperator, name: str) -> torch.Tensor | None:
    """A 0.x initial vector (tensor or array, any device) as a flat vector for ``op``."""
    if vec is None:
        return None
    if isinstance(vec, np.ndarray):
        vec = torch.from_numpy(vec)
    if not isinstance(vec, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(vec).__name__}")
    if vec.numel() != op.size:
        raise ValueError(
            f"{name} must have {op.size} entries (the operator size), got shape {tuple(vec.shape)}"
        )
    return vec.reshape(-1).to(device=op.device, dtype=op.dtype)


def seed_from_global_rng() -> int:
    """A seed for the core drawn from torch's global generator.

    0.x drew its random start vectors from the global generator, so 0.x code
    makes runs repeatable with ``torch.manual_seed``; the 1.0 algorithms never
    touch it and take ``seed=`` instead. Drawing the seed here keeps the 0.x
    behaviour.
    """
    return int(torch.randint(0, 2**62, (1,)).item())


def as_numpy(t: torch.Tensor) -> np.ndarray[Any, Any]:
    return t.detach().cpu().numpy()


def sorted_pairs(
    values: torch.Tensor, vectors: torch.Tensor, *, descending: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs ``(values (k,), vectors (k, n))`` in 0.x order (a stable sort of the values).

    The values are sorted on the host; pairs already in order (the usual case)
    are returned as they are, without an indexing copy.
    """
    host = values.detach().cpu()
    keys = host.tolist()  # k numbers: a Python check costs ~1 us, a tensor sort ~10 us
    pairs = itertools.pairwise(keys)
    if all(a >= b for a, b in pairs) if descending else all(a <= b for a, b in pairs):
        return host, vectors
    index = torch.argsort(host, descending=descending, stable=True)
    return host[index], vectors[index.to(vectors.device)]


def core_convergence_warning_off() -> contextlib.AbstractContextManager[None]:
    """Silence the core's ConvergenceWarning: it speaks 1.0 arguments (``max_iter``, the
    translated ``tol``) and points into the facade; ``warn_unconverged`` says it in 0.x terms.
    No filter change (see NOTE [quiet convergence warnings] in ``algorithms.result``)."""
    return quiet_convergence_warnings()


def warn_unconverged(what: str, converged: torch.Tensor, advice: str) -> None:
    """ConvergenceWarning at the user's line when some pair missed the tolerance (0.x words)."""
    done, k = int(converged.sum()), int(converged.numel())
    if done < k:
        warnings.warn(
            f"{what}: {done} of {k} eigenpairs converged; {advice}",
            ConvergenceWarning,
            stacklevel=user_stacklevel(),
        )
