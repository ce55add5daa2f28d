"""Influence on a model sharded with FSDP2: ``fit(model, my_shard, task, ranks=Sharded(model))``.

NOTE [influence on sharded ranks]: the Kronecker factors are those of the FSDP Kronecker
operators (``FSDPEKFACOperator`` / ``FSDPKFACOperator``: each rank's shard of the training data,
the sums all-reduced), replicated on every rank. Per-example gradients are whole on every rank:
FSDP shards parameters, not activations, so the hooked layers see whole inputs and output
gradients (NOTE [per-example gradients on sharded ranks] in ``gradients``). So every rank holds
the whole preconditioned queries and applies the damped inverse to whole rows itself, from the
replicated factors (:func:`whole_kronecker`: no communication, the same arithmetic as one
process), and scores its own training examples against them with no communication either.

What the ranks must share is FSDP's collectives: each batch's gradients are FSDP forwards and
backwards on every rank. So a scoring call reads its batches in step (:meth:`ShardedScoring.
batches`): before each batch the ranks agree that every rank has one or none has (an empty
batch on every rank or on none; their sizes may differ), refusing otherwise in one line on
every rank, and a failure of one rank (its data, its batch's check, its loss) raises on all.
Query batches must be the same on every rank (sizes and a checksum of their tensors): their
slices through the model are collectives too, and every rank's columns are scores against the
same queries. Memory per rank: the whole per-example gradients of a batch and the whole
preconditioned queries, as one process; the factors, as the FSDP Kronecker operators.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from hessian_eigenthings.batching import Batch, batch_size, map_tensors
from hessian_eigenthings.operators.kfac import KFACOperator
from hessian_eigenthings.operators.kronecker import KroneckerOperator
from hessian_eigenthings.operators.protocol import CurvatureOperator
from hessian_eigenthings.operators.ranks import Ranks, is_dtensor
from hessian_eigenthings.operators.sharded import Sharded, fsdp2_class, mesh_group

__all__ = ["ShardedScoring", "check_sharded_fit", "refuse_sharded_model", "whole_kronecker"]

#: numbers every agreement of a scoring call carries (a batch's state, size and checksum): a
#: rank that fails between two agreements joins the next one, whichever it is
WIDTH = 3
_END: Any = object()  # no batch left
T = TypeVar("T")


def check_sharded_fit(model: nn.Module, ranks: Sharded, curvature: str) -> None:
    """Refuse what ``fit`` cannot do on sharded ranks, in one line (the same on every rank)."""
    if curvature not in ("ekfac", "kfac"):
        raise ValueError(
            f"curvature={curvature!r} on Sharded ranks: influence on a model sharded with FSDP2 "
            "runs on the Kronecker routes ('ekfac', 'kfac'); the exact routes solve on the whole "
            "model (a replicated model with ranks=Replicated())"
        )
    fsdp2_class(model, "ranks=Replicated()")  # a model not sharded with fully_shard
    mesh_group(model, ranks.group)  # the ranks span the model's mesh


def refuse_sharded_model(model: nn.Module, ranks: Ranks | None) -> None:
    """Refuse a model sharded with FSDP2 given other ranks than :class:`Sharded`."""
    if any(is_dtensor(p) for p in model.parameters()):
        given = "no ranks" if ranks is None else repr(ranks)
        raise TypeError(
            f"the model's parameters are sharded with FSDP2 (DTensor) and {given} were given: "
            "pass ranks=Sharded(model) (hessian_eigenthings.operators.distributed)"
        )


def whole_kronecker(op: CurvatureOperator) -> CurvatureOperator:
    """``op`` over whole vectors: itself, or for an FSDP Kronecker operator (sharded vectors,
    replicated factors) the same blocks over its whole layout (NOTE [influence on sharded
    ranks]): K-FAC's factors, EK-FAC's eigenbases and corrected eigenvalues."""
    whole = getattr(op, "global_layout", None)
    if whole is None:
        return op
    if isinstance(op, KFACOperator):
        return KroneckerOperator(whole, op.factors)
    return KroneckerOperator(whole, op.eigh().blocks)  # type: ignore[attr-defined]


def checksum(batch: Batch) -> float:
    """A number that differs between batches that differ (their tensors' entries, weighted by
    position), read on the host."""
    total = 0.0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) % 7 + 1
        total += float(flat @ weights)
        return t

    map_tensors(batch, add)
    return total


class ShardedScoring:
    """The ranks of a model sharded with FSDP2 as influence scoring meets them (NOTE [influence
    on sharded ranks]); the ``ShardedPasses`` of its per-example gradients."""

    def __init__(self, model: nn.Module, ranks: Sharded) -> None:
        self.model = model
        self.ranks = ranks
        self.agreement = ranks.agreement

    def meet(self, failure: BaseException | None, what: str) -> None:
        self.agreement.agree(failure, *([0.0] * WIDTH), what=what)

    def reshard(self) -> None:
        self.ranks.reshard(self.model)

    def span(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A scoring call: a rank failing between two agreements joins the next one, flagged."""
        return self.agreement.meetings(what, WIDTH)

    def agreed(self, run: Callable[[], T], what: str) -> T:
        """``run()`` on every rank; raises on every rank when it raised on one."""
        failure: BaseException | None = None
        result: Any = None
        try:
            result = run()
        except Exception as exc:
            failure = exc
        self.meet(failure, what)
        return result

    def smallest(self, run: Callable[[], int], what: str) -> int:
        """The smallest of every rank's ``run()``."""
        failure: BaseException | None = None
        value = 0
        try:
            value = run()
        except Exception as exc:
            failure = exc
        table = self.agreement.agree(failure, value, 0.0, 0.0, what=what)
        return int(table[:, 0].min())

    def same(self, value: int, what: str) -> None:
        """Refuse, on every rank, ranks whose ``value`` (``what``) differ."""
        table = self.agreement.agree(None, value, 0.0, 0.0, what=what)
        values = [int(v) for v in table[:, 0].tolist()]
        if len(set(values)) > 1:
            self.agreement.refuse(
                f"the ranks differ in {what} ({values}); every rank must resume from the same point"
            )

    def batches(
        self,
        start: Callable[[], Iterator[Batch]],
        what: str,
        check: Callable[[int, Batch], None],
        *,
        same: bool,
        last: bool,
    ) -> Iterator[tuple[int, Batch]]:
        """``(i, batch)`` of ``start()``'s batches, the ranks agreeing before each (every rank
        has one or none has; ``same``: the same batch on every rank); ``check(i, batch)`` each.
        ``last``: the call's last agreement is this loop's end."""
        batches: Iterator[Batch] | None = None
        for position in itertools.count():
            failure: BaseException | None = None
            batch: Any = _END
            # 0: no batch left; 1: a batch; 2: an empty batch (no forward on any rank)
            state, size, mark = 0.0, 0.0, 0.0
            try:
                if batches is None:
                    batches = start()
                batch = next(batches, _END)
                if batch is not _END:
                    check(position, batch)
                    size = float(batch_size(batch))
                    state = 1.0 + float(size == 0)
                    mark = checksum(batch) if same else 0.0
            except Exception as exc:
                failure = exc
            table = self.agreement.agree(
                failure, state, size, mark, what=f"reading {what}", last=last and batch is _END
            )
            states, sizes, marks = (table[:, c].tolist() for c in range(WIDTH))
            if len(set(states)) > 1:
                said = {0.0: "no batch left", 1.0: "a batch", 2.0: "an empty batch"}
                seen = "; ".join(f"rank {r}: {said[s]}" for r, s in enumerate(states))
                self.agreement.refuse(
                    f"{what}: at batch {position} the ranks differ ({seen}). On a model sharded "
                    "with FSDP2 a batch's gradients are FSDP forwards and backwards on every rank: "
                    "every rank passes the same number of batches, and an empty batch on every "
                    "rank or on none (their sizes may differ)"
                )
            scale = max(abs(m) for m in marks)
            if same and (len(set(sizes)) > 1 or max(marks) - min(marks) > 1e-9 * max(scale, 1.0)):
                counts = [int(s) for s in sizes]
                seen = f"sizes {counts}" if len(set(counts)) > 1 else "other values"
                self.agreement.refuse(
                    f"{what} batch {position} differs across ranks ({seen}): every rank passes "
                    "the same queries, and scores its own training examples against them"
                )
            if batch is _END:
                return
            yield position, batch
