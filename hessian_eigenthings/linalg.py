"""Vector arithmetic the algorithms use, behind a small protocol.

On one device this is plain torch. A distributed backend (sharded vectors)
implements the same four reductions with an all-reduce, so the algorithms
run unchanged when each rank holds a shard of every vector.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LinAlgBackend(Protocol):
    """Reductions over flat vectors (or row blocks ``(k, n)``) that may be sharded."""

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``<a, b>`` as a 0-d tensor (no host sync)."""
        ...

    def norm(self, a: torch.Tensor) -> torch.Tensor:
        """``||a||_2`` as a 0-d tensor."""
        ...

    def inner_rows(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """``A @ B.T`` for row blocks ``A (p, n)``, ``B (q, n)``: shape ``(p, q)``."""
        ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the shards (identity on one device)."""
        ...


class SingleDeviceBackend:
    """Every vector lives whole on one device."""

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.dot(a.reshape(-1), b.reshape(-1))

    def norm(self, a: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(a)

    def inner_rows(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return A @ B.T

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # Vector helpers of the 1.0 alpha's backend, kept for code written against it. The
    # algorithms do not use them (so a custom LinAlgBackend need not implement them).
    def axpy(self, alpha: float | torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``alpha * a + b`` (a new tensor)."""
        return alpha * a + b

    def scale(self, alpha: float | torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """``alpha * a`` (a new tensor)."""
        return alpha * a

    def zeros_like(self, a: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(a)

    def randn_like(
        self, a: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Standard normal entries shaped like ``a``; a generator on another device is fine."""
        if generator is None or generator.device == a.device:
            return torch.randn(a.shape, dtype=a.dtype, device=a.device, generator=generator)
        return torch.randn(a.shape, generator=generator, device=generator.device).to(
            a.device, a.dtype
        )

    def rademacher_like(
        self, a: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Entries ``±1`` with equal probability, shaped like ``a``."""
        where = a.device if generator is None else generator.device
        bits = torch.randint(0, 2, a.shape, generator=generator, device=where)
        return bits.to(device=a.device, dtype=a.dtype) * 2 - 1


def default_backend(backend: LinAlgBackend | None) -> LinAlgBackend:
    if backend is None:
        return SingleDeviceBackend()
    if not isinstance(backend, LinAlgBackend):
        raise TypeError(
            f"backend must implement LinAlgBackend (dot, norm, inner_rows, all_reduce_sum); got {type(backend).__name__}"
        )
    return backend
