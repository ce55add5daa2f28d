"""Vector arithmetic for vectors sharded across the ranks of a process group.

In sharded mode (an FSDP model, see ``operators.distributed``) every rank
holds a slice of each vector: ``v = concat_r v_r``. Reductions are local
reductions followed by one all-reduce each:

    <a, b> = Σ_r <a_r, b_r>        ‖a‖ = sqrt(Σ_r ‖a_r‖²)        A Bᵀ = Σ_r A_r B_rᵀ

Elementwise arithmetic (axpy, scaling) needs no communication, so an
algorithm written against :class:`~hessian_eigenthings.linalg.LinAlgBackend`
runs unchanged with :class:`DistributedBackend` and returns the same scalars
on every rank. Cost: one all-reduce of the result's size (a scalar, or
``p × q`` for ``inner_rows``) per call; no host synchronisation.

Also here, below the operators and the algorithms, so that both can use
them: :func:`is_main_process` (who prints progress) and the group checks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedBackend", "is_main_process", "resolve_process_group"]


def resolve_process_group(process_group: Any = None) -> Any:
    """The group to use (``None`` means the default group); fails clearly when
    ``torch.distributed`` is not initialized."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: launch with `torchrun --nproc_per_node=N script.py` "
            "and call torch.distributed.init_process_group() (backend 'nccl' on GPUs, 'gloo' on CPUs) "
            "before building a distributed operator"
        )
    return dist.group.WORLD if process_group is None else process_group


def is_main_process(process_group: Any = None) -> bool:
    """True on the rank that should print progress and write files: rank 0 of
    ``process_group``, or the only process when ``torch.distributed`` is not in use."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    group = dist.group.WORLD if process_group is None else process_group
    return dist.get_rank(group) == 0


class DistributedBackend:
    """:class:`~hessian_eigenthings.linalg.LinAlgBackend` for sharded vectors.

    Each rank passes its local shard (any length, possibly different per rank,
    possibly empty); results are the global reductions, identical on every
    rank. ``rank`` and ``world_size`` are the caller's position in the group;
    algorithms seed their random probes with ``rank`` so that the shards of a
    probe are independent (identical shards would bias Hutchinson-type
    estimators).
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = resolve_process_group(process_group)
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return t

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._sum(torch.dot(a.reshape(-1), b.reshape(-1)))

    def norm(self, a: torch.Tensor) -> torch.Tensor:
        # sum of squares of the shards, then one root: exact up to rounding
        return self._sum(torch.linalg.vector_norm(a).square()).sqrt()

    def inner_rows(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return self._sum(A @ B.T)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        # a copy: callers may keep using their local partial sums
        return self._sum(t.clone())

    def __repr__(self) -> str:
        return f"DistributedBackend(rank={self.rank}, world_size={self.world_size})"
