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


def default_backend(backend: LinAlgBackend | None) -> LinAlgBackend:
    if backend is None:
        return SingleDeviceBackend()
    if not isinstance(backend, LinAlgBackend):
        raise TypeError(
            f"backend must implement LinAlgBackend (dot, norm, inner_rows, all_reduce_sum); got {type(backend).__name__}"
        )
    return backend
