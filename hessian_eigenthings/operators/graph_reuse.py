"""Graph reuse: a product's state (forward, first-order graph, or a traced
program's primal values) kept across products while nothing it read changed.

:class:`StateCache` holds the kept states of one operator, keyed by the
position of their chunk in a pass, and bounds them by count and bytes (NOTE
[graph reuse]). Each is checked against the reuse key on every product (NOTE
[reuse key]: host integers only, no tensor reads) by the data loop
(``base.kept_state``), with the model's part that the model guard's scope reads
once per pass (``model_guard.model_key``) and the batch's (``batching.same_batch``):
a steady product does not enter this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hessian_eigenthings import _torch_compat
from hessian_eigenthings.batching import Batch, batch_key, batch_leaves, same_batch
from hessian_eigenthings.operators.model_guard import (
    model_key,
    model_tensors,
    watch_optimizer_steps,
)

__all__ = [
    "KeptState",
    "StateCache",
    "batch_key",
    "batch_leaves",
    "model_tensors",
    "parameter_norms",
    "same_batch",
    "watch_optimizer_steps",
]

# NOTE [reuse key]
# A kept state (any engine's) answers for the model only while nothing it read
# has changed. The key covers every parameter and buffer of the model — selected
# or not, since frozen and unselected tensors shape the product too — by object
# and version counter, every module's training flag (dropout and BatchNorm
# change behaviour with it), the global precision switches (NOTE [product
# precision]), and the batch (below). Our own forwards never bump the user's
# versions: training modules get private buffer copies (`private_buffers`), and
# finite differences perturb copies. Reading it costs a tuple of host integers
# per product: no tensor reads, no device sync.

# NOTE [updates that keep the version]
# Two common ways to change parameters leave their version counters alone:
# fused optimizer steps (`torch.optim.AdamW(fused=True)`, the HuggingFace
# Trainer's default on recent torch; `SGD(fused=True)`), and writes through
# `.data` (`p.data.add_(...)`, `p.data.copy_(...)`: an EMA, old-style SGD).
# A kept state would then answer for the old parameters (a 1.2% error was
# measured after one fused AdamW step). So:
# - every `torch.optim` optimizer step, fused or not, bumps a process-wide
#   counter (a global step post-hook registered once, the first time an
#   operator keeps a state) that is part of the reuse key: still host integers
#   only;
# - each kept state records the parameters' norms when it is built (device
#   work, no sync), and `expect_products` — called once by every algorithm
#   before its products — compares them with the current norms (one sync per
#   algorithm call) and drops the states that no longer match. A `.data` write
#   between two bare `op @ v` calls is not seen: call `op.clear_cache()` then.
# (the counter and `watch_optimizer_steps` are model_guard's: the model's key reads it)


def parameter_norms(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' norms as one device tensor (NOTE [updates that keep the version])."""
    with torch.no_grad():
        return torch.stack(torch._foreach_norm([p.detach() for p in params]))


# NOTE [graph reuse]
# A Hessian product from scratch costs forward + backward(create_graph) +
# double backward. When the data of a product is one batch (or a few), the
# graph of the first backward can be kept, and every further product costs
# only the second backward. The cached state is valid while (a) no selected
# parameter and no buffer changed (tensor version counters, read on the host,
# no sync) and (b) the batch is the same: the same tensor objects at the same
# versions, else equal contents (one cheap comparison of the input batch).
# Memory is bounded by `graph_reuse_max_batches` and, on CUDA, by
# `graph_memory_budget` bytes measured when each graph is built.


#: the default ``graph_memory_budget``: this fraction of the device (NOTE [memory budget])
DEFAULT_BUDGET_FRACTION = 0.5
#: ... and a state is kept by default only while this fraction of the device stays free
FREE_FRACTION = 0.1

# NOTE [memory budget]
# Kept states and their CUDA-graph pools may hold up to `graph_memory_budget`
# bytes on CUDA, by default half the device, measured as they are built; with
# the default, a state is also not kept when less than a tenth of the device
# would stay free (free to the driver plus what the caching allocator holds
# unused), so memory the user's own tensors take is left to them. A quarter
# of the device (the default until session 12) kept neither the compiled
# Hessian state of GPT-2 12L at 4x512 (20.8 GB of 79 GB) nor the recording of
# autograd's (7.5 GB state, 5.9 GB pool): 152 ms and 124 ms per product
# against 53 ms for a gradient (H100). A Lanczos basis for that model is
# 0.5 GB per vector.


def _headroom(device: torch.device) -> bool:
    """Whether a tenth of ``device`` is free (driver free plus the allocator's unused cache)."""
    free, total = torch.cuda.mem_get_info(device)
    unused = _torch_compat.cuda_reserved(device) - _torch_compat.cuda_allocated(device)
    return free + unused >= FREE_FRACTION * total


@dataclass
class KeptState:
    """The state of one chunk, kept between products, and its recordings (NOTE [CUDA graphs])."""

    raw: tuple[list[Any], tuple[int, ...]]
    versions: tuple[Any, ...]
    state: Any
    size: int
    nbytes: int
    #: the norms of the model's parameters and floating-point buffers when the state was built
    #: (NOTE [updates that keep the version])
    norms: torch.Tensor | None = None
    #: block widths that ran eagerly once on this state (warm-up before a capture)
    warm: set[int] = field(default_factory=set)
    #: block widths whose recording was attempted (one attempt per width and state)
    attempted: set[int] = field(default_factory=set)
    #: the recordings of ``apply`` on this state by block width (``cuda_graphs.Replay``)
    replays: dict[int, Any] = field(default_factory=dict)


class StateCache:
    """The kept states of one operator over ``modules`` (the model's) on ``device``: at most
    ``max_batches``, holding at most ``memory_budget`` bytes on CUDA (default half the device,
    NOTE [memory budget]). ``keep``: whether states may be kept at all (a batch cycled per product is not)."""

    def __init__(
        self,
        modules: list[nn.Module],
        device: torch.device,
        *,
        max_batches: int,
        memory_budget: int | None,
        keep: bool = True,
    ) -> None:
        self.modules = modules
        self.device = device
        self.max_batches = max_batches
        self.memory_budget = memory_budget
        self.keep = keep
        self.entries: dict[tuple[int, int], KeptState] = {}
        #: device bytes held: kept states and their recordings
        self.nbytes = 0
        #: bytes of the last state that did not fit the budget (no keeping until room frees up)
        self.unkept_bytes = 0
        self._default_budget: int | None = None

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
        self.unkept_bytes = 0

    def versions(self) -> tuple[Any, ...]:
        """The reuse key's model part, see NOTE [reuse key] (``model_guard.model_key``; a pass
        reads it once, entering the guard's scope)."""
        return model_key(self.modules)

    def drop_changed(self) -> int:
        """Drop the kept states whose parameters' norms changed since they were built (writes
        that keep version counters, NOTE [updates that keep the version]); one device sync.
        Returns how many were dropped."""
        entries = [(key, e.norms) for key, e in self.entries.items() if e.norms is not None]
        if not entries:
            return 0
        now = parameter_norms(self.watched())
        stale = [key for key, norms in entries if not torch.equal(norms, now)]
        for key in stale:
            self.nbytes -= self.entries.pop(key).nbytes
        return len(stale)

    def watched(self) -> list[torch.Tensor]:
        """Every parameter and floating-point buffer of the model (what a kept state read)."""
        return [t for t in model_tensors(self.modules) if t.is_floating_point()]

    def drop(self, key: tuple[int, int]) -> None:
        """Forget the state of chunk ``key`` (it no longer answers for the model or its batch:
        the data loop checks, NOTE [reuse key])."""
        self.nbytes -= self.entries.pop(key).nbytes

    def budget(self) -> int | None:
        if self.memory_budget is not None or self.device.type != "cuda":
            return self.memory_budget
        if (
            self._default_budget is None
        ):  # read once: this is asked on every product without a kept state
            self._default_budget = int(
                DEFAULT_BUDGET_FRACTION * torch.cuda.get_device_properties(self.device).total_memory
            )
        return self._default_budget

    def may_keep(self) -> bool:
        """Whether the state of the next chunk may be kept (else it is a fresh product)."""
        if not self.keep or len(self.entries) >= self.max_batches:
            return False
        budget = self.budget()
        return budget is None or self.nbytes + self.unkept_bytes <= budget

    def build(
        self,
        key: tuple[int, int],
        raw: Batch,
        chunk: Batch,
        prepare: Callable[[Batch], Any],
        samples: Callable[[Batch], int],
    ) -> tuple[Any, bool]:
        """Build the state of one chunk with ``prepare(chunk)``; keep it (with ``samples(chunk)``,
        read once the state is built) when the budget allows. Returns (state, kept)."""
        cuda = self.device.type == "cuda"
        before = _torch_compat.cuda_allocated(self.device) if cuda else 0
        watch_optimizer_steps()
        versions = self.versions()
        raw_key = batch_key(raw)
        norms = parameter_norms(self.watched())
        state = prepare(chunk)
        nbytes = (_torch_compat.cuda_allocated(self.device) - before) if cuda else 0
        budget = self.budget()
        if (budget is not None and self.nbytes + nbytes > budget) or (
            cuda and self.memory_budget is None and not _headroom(self.device)
        ):
            self.unkept_bytes = nbytes
            return state, False
        self.unkept_bytes = 0
        self.entries[key] = KeptState(
            raw=raw_key,
            versions=versions,
            state=state,
            size=samples(chunk),
            nbytes=nbytes,
            norms=norms,
        )
        self.nbytes += nbytes
        return state, True
