"""0.x ``HVPOperator``: the 1.0 :class:`HessianOperator` with 0.x arguments.

``HVPOperator(model, dataloader, criterion, use_gpu=True, fp16=False,
full_dataset=True, max_possible_gpu_samples=256)`` maps onto
``HessianOperator(model, dataloader, loss_fn, full_dataset=...,
microbatch_size=max_possible_gpu_samples)`` with ``loss_fn(model, (x, y)) =
criterion(model(x), y)``. What differs from a plain ``HessianOperator``, and
why, is listed in migration_guide.md ('HVPOperator'):

- batches are averaged with equal weights, as 0.x did (1.0 weights them by
  size); see NOTE [0.x batch weighting];
- ``fp16=True``: the operator takes and returns float16 vectors (the model
  computes in its own dtype);
- chunks of a split batch are weighted by size, so a batch's product is its
  exact mean (0.x averaged the chunks with equal weights, a bias when the
  last chunk is short); splitting is allowed for BatchNorm in training mode,
  as in 0.x.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from hessian_eigenthings.batching import batch_size
from hessian_eigenthings.compat._deprecations import warn_deprecated
from hessian_eigenthings.compat._translate import flag, real, requested_device
from hessian_eigenthings.compat.operator import Operator
from hessian_eigenthings.loss_fns.standard import supervised_loss
from hessian_eigenthings.operators.hessian import HessianOperator

Criterion = Callable[[Any, Any], torch.Tensor]


def _microbatch_size(dataloader: Iterable[Any], chunk: int) -> int | None:
    """``microbatch_size`` for ``max_possible_gpu_samples=chunk``: ``None`` when no batch can exceed it.

    Nothing to split then, and the core skips its microbatch bookkeeping (a
    batch-size probe per batch and product: ~2-3% of a product of a tiny
    model). Decided when it is known up front: a torch ``DataLoader`` yields
    at most ``batch_size`` samples per batch, and a list or tuple of batches
    is inspected once. Anything else keeps the chunk size.
    """
    if isinstance(dataloader, DataLoader):
        size = dataloader.batch_size
        return None if isinstance(size, int) and size <= chunk else chunk
    if isinstance(dataloader, (list, tuple)):
        try:
            largest = max((batch_size(b) for b in dataloader), default=chunk + 1)
        except (TypeError, ValueError):
            return chunk  # the core raises its own error on such a batch
        return None if largest <= chunk else chunk
    return chunk


# NOTE [0.x batch weighting]
# 0.x averaged the per-batch Hessians with equal weights, (1/B) Σ H_i; the 1.0
# core weights by batch size, Σ b_i H_i / Σ b_i. The two agree when every batch
# has the same size and differ when the last one is short. The facade keeps the
# 0.x average through the core's batch_weighting="uniform" (the weighting is
# the core's job: the facade only selects it).
# When the batches are known to have one size (a list or tuple of batches, a
# DataLoader whose last batch is full or dropped) the two averages are the
# same and the facade selects the core's default: then it is exactly the
# HessianOperator a 1.0 user writes, and skips a batch-size probe per batch
# and product that the uniform weighting needs.


def _equal_batches(dataloader: Iterable[Any]) -> bool:
    """Whether every batch of ``dataloader`` is known up front to have the same size."""
    if isinstance(dataloader, DataLoader):
        size = dataloader.batch_size
        if not isinstance(size, int) or isinstance(dataloader.dataset, IterableDataset):
            return False
        if dataloader.drop_last:
            return True
        try:
            return len(dataloader.dataset) % size == 0  # type: ignore[arg-type]
        except TypeError:
            return False
    if isinstance(dataloader, (list, tuple)):
        try:
            return len({batch_size(b) for b in dataloader}) == 1
        except (TypeError, ValueError):
            return False
    return False


# NOTE [0.x use_gpu]
# 0.x's HVPOperator called model.cuda() when use_gpu was truthy (the default) and moved
# every batch to CUDA as it read it; scripts written for 0.x build the model on the CPU
# and rely on that (running them on the CPU after an upgrade made them several times
# slower). The facade does the same: the model goes to CUDA in place (nn.Module.cuda()
# moves the module itself, as in 0.x), and the core moves each batch to the model's
# device as it reads it. Without CUDA, 0.x crashed; the facade warns and stays on the CPU.


def _chunk_size(value: Any) -> int | None:
    """0.x ``max_possible_gpu_samples`` as a microbatch size; ``None``: never split.

    0.x split a batch of ``B`` samples into ``max(1, B // value)`` chunks, so a
    negative value never split, zero divided by zero, and a float split as
    its integer part would.
    """
    m = real(
        "max_possible_gpu_samples", value, hint="1.0: HessianOperator(..., microbatch_size=...)"
    )
    if m == 0:
        raise ValueError(
            "max_possible_gpu_samples must not be 0 (0.x raised ZeroDivisionError; "
            "1.0: HessianOperator(..., microbatch_size=...))"
        )
    if not m > 0 or math.isinf(m):  # negative or NaN: max(1, B // m) was 1 chunk
        return None
    return max(1, int(m))


class _HVPOperator(HessianOperator):
    """The 0.x Hessian operator without the deprecation warning (for ``compute_hessian_eigenthings``)."""

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Any],
        criterion: Criterion,
        use_gpu: bool = True,
        fp16: bool = False,
        full_dataset: bool = True,
        max_possible_gpu_samples: int = 256,
    ) -> None:
        if not callable(criterion):
            raise TypeError(
                "criterion must be callable as criterion(output, target) (1.0: "
                "HessianOperator(model, dataloader, supervised_loss(criterion)))"
            )
        # See NOTE [0.x use_gpu]
        if requested_device(use_gpu, "HVPOperator").type == "cuda":
            model = model.cuda()
        chunk = _chunk_size(max_possible_gpu_samples)
        super().__init__(
            model,
            dataloader,
            supervised_loss(criterion),
            full_dataset=flag(full_dataset),
            microbatch_size=None if chunk is None else _microbatch_size(dataloader, chunk),
            # 0.x split BatchNorm batches too; 1.0 asks for consent, which 0.x code cannot give
            microbatch_unsafe=True,
            # 0.x computed in the model's dtype (a half model's products in half): so does the
            # facade, whatever 1.0's default (NOTE [half models] in operators.precision)
            precision="model",
        )
        # See NOTE [0.x batch weighting]
        self.batch_weighting = "size" if _equal_batches(dataloader) else "uniform"
        # the 0.x attributes, for code that reads them
        self.dataloader = dataloader
        self.criterion = criterion
        self.use_gpu = use_gpu
        self.fp16 = flag(fp16)
        self.full_dataset = full_dataset
        self.max_possible_gpu_samples = max_possible_gpu_samples
        if self.fp16:
            self._dtype = torch.float16

    def _matmat_rows(self, V: torch.Tensor) -> torch.Tensor:
        if not self.fp16:
            return super()._matmat_rows(V)
        # fp16=True: half vectors in and out, products in the model's dtype
        return super()._matmat_rows(V.to(self.layout.dtype)).to(V.dtype)

    def apply(self, vec: torch.Tensor) -> torch.Tensor:
        """0.x ``apply``: ``H vec`` for a flat vector on any device and of any floating dtype."""
        if not isinstance(vec, torch.Tensor):
            raise TypeError(
                f"vec must be a torch.Tensor, got {type(vec).__name__} (1.0: op.matvec(v))"
            )
        return self.matvec(vec.reshape(-1).to(device=self.device, dtype=self.dtype))

    def zero_grad(self) -> None:
        """0.x ``zero_grad``: zero the ``.grad`` of the model's parameters (1.0 operators never touch them)."""
        self.model.zero_grad(set_to_none=False)

    _zero_grad = zero_grad  # the name 0.x's HVPOperator used


class HVPOperator(_HVPOperator):
    """0.x Hessian-vector-product operator. Deprecated: use :class:`HessianOperator`.

    Warns at construction. It is a 1.0 operator: every 1.0 algorithm accepts it.
    """

    def __init__(
        self,
        model: nn.Module,
        dataloader: Iterable[Any],
        criterion: Criterion,
        use_gpu: bool = True,
        fp16: bool = False,
        full_dataset: bool = True,
        max_possible_gpu_samples: int = 256,
    ) -> None:
        warn_deprecated("HVPOperator")
        super().__init__(
            model, dataloader, criterion, use_gpu, fp16, full_dataset, max_possible_gpu_samples
        )


# 0.x HVPOperator was an Operator: keep isinstance checks of 0.x code true
Operator.register(HVPOperator)
