"""The runner interface: how a curvature's per-batch products run, from arguments (DESIGN §7).

A runner is two calls: ``prepare(batch, params)`` builds a batch's state (a forward and the
first-order graph for autograd, a traced program's primal values for the traced runners) and
``apply(state, vectors, retain)`` returns the products of the curvature with a block of
directions (``vectors[i]``: ``(k, *shape_i)``; one ``(k, *shape_i)`` tensor or ``None`` for an
exact zero per parameter). ``params``: tensors standing in for the selected parameters in the
state's graph (``None``: the parameters themselves). Runners know nothing of the operator: the
data loop, the kept states and the CUDA-graph recorder call them with what they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from hessian_eigenthings.batching import Batch

EngineName = Literal["auto", "autograd", "functional", "compiled", "layers"]
ENGINES: tuple[str, ...] = ("auto", "autograd", "functional", "compiled", "layers")

#: relative difference between a traced product and its reference beyond which the traced one is
#: distrusted (rounding differs between engines, a wrong trace differs by O(1))
MISMATCH_TOL: dict[torch.dtype, float] = {torch.float64: 1e-8, torch.float32: 1e-3}

#: ``apply(state, vectors, retain)`` of the runner interface
Apply = Callable[[Any, list[torch.Tensor], bool], Sequence[torch.Tensor | None]]


class EngineUnsupportedError(ValueError):
    """The chosen engine cannot run this model or batch; the message names the alternative."""


class ProductRunner(Protocol):
    """How one curvature's per-batch products run (see the module docstring)."""

    #: the engine's name (``engine=``)
    name: str
    #: products run through a traced program (plain tensor programs: math attention, recordable
    #: as CUDA graphs whatever the curvature)
    traced: bool

    def prepare(self, batch: Batch, params: Sequence[torch.Tensor] | None = None) -> Any: ...

    def apply(
        self, state: Any, vectors: list[torch.Tensor], retain: bool
    ) -> Sequence[torch.Tensor | None]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class ProductCounts:
    """Cost counters of one operator's products, shared by its collaborators (noise-free costs
    for tests and benchmarks): passes over the data (one per batch chunk), forward passes,
    replayed CUDA-graph products, products asked for."""

    passes: int = 0
    forwards: int = 0
    replays: int = 0
    #: directions the operator's products were asked for (``auto`` judges a loop by it)
    products: int = 0


class AutogradRunner:
    """A curvature's own reverse-mode hooks (``_prepare`` / ``_apply``), run as they are.

    ``apply`` *is* the curvature's hook (no frame of the runner's between the data loop and the
    curvature); ``prepare`` passes ``params`` on to a hook that takes them (``takes_params``).
    """

    name = "autograd"
    traced = False

    def __init__(self, prepare: Callable[..., Any], apply: Apply, *, takes_params: bool) -> None:
        self.apply = apply
        self._prepare = prepare
        self._takes_params = takes_params

    def prepare(self, batch: Batch, params: Sequence[torch.Tensor] | None = None) -> Any:
        if self._takes_params:
            return self._prepare(batch, params)
        return self._prepare(batch)

    def describe(self) -> dict[str, Any]:
        return {}


class CountField:
    """An operator attribute that reads and writes one field of its ``counts``
    (``op.num_forwards += 1`` keeps working where the counters are shared)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, obj: Any, owner: type | None = None) -> int:
        return int(getattr(obj.counts, self.field))

    def __set__(self, obj: Any, value: int) -> None:
        setattr(obj.counts, self.field, value)


def unsupported(engine: str, owner: str, reason: str) -> EngineUnsupportedError:
    """The error for a traced ``engine`` that ``owner`` cannot run with its options (``reason``)."""
    return EngineUnsupportedError(
        f"engine={engine!r} is not available for {owner} with these options ({reason}); pass engine='autograd'"
    )
